"""The GPU step-time check's own arithmetic (bench/gpu/step_time_check.py), testable without a GPU: the device
time of the last iteration of a trace, and the torch.profiler reference failing open where no GPU is present."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))
import step_time_check as check  # noqa: E402


def op(name, start, end, device_ns, parent=-1, depth=0):
    return {"name": name, "start_seq": start, "end_seq": end, "device_ns": device_ns, "parent": parent,
            "depth": depth}


def test_iteration_kernels_sum_the_last_iteration_outermost_ops():
    doc = {"ops": [
        op("aten::linear", 1, 4, 1_000_000),                      # first iteration: before its optimizer step
        op("Optimizer.step#AdamW.step", 5, 8, 200_000),
        op("aten::linear", 9, 12, 1_500_000),                     # the last iteration
        op("aten::addmm", 10, 11, 1_400_000, parent=2, depth=1),  # counted in its parent
        op("aten::cross_entropy_loss", 13, 14, 250_000),          # outside any layer: counted
        op("aten::view", 15, 16, -1),                             # no device time
        op("Optimizer.step#AdamW.step", 17, 20, 300_000),
        op("aten::linear", 21, 22, 7_000_000),                    # after the last optimizer step
    ]}
    assert check.iteration_kernels_ms(doc) == pytest.approx(2.05, abs=1e-12)


def test_iteration_kernels_without_device_times_is_none():
    assert check.iteration_kernels_ms({"ops": [op("aten::mm", 1, 2, -1)]}) is None
    assert check.iteration_kernels_ms({}) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path without a GPU")
def test_profiler_reference_fails_open_without_a_gpu():
    ms, events, error = check.profiler_kernels_ms(lambda b: torch.ones(2).sum(), None, runs=1)
    assert (ms, events) == (None, 0)
    assert error.startswith("RuntimeError: ") or error.startswith("AssertionError: ")


def test_the_check_runs_end_to_end_on_the_cpu_with_the_stand_in_timer():
    """The whole script as bench/gpu/run.sh runs it, on the CPU with the stand-in device timer (CPU clock spans
    through the device-timing path): it must not rot between GPU runs."""
    import json
    import os
    import subprocess
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=f"{root / 'python'}:{root}")
    out = subprocess.run([sys.executable, str(root / "bench" / "gpu" / "step_time_check.py"), "--target", "cpu",
                          "--device", "cpu", "--stand-in", "--cases", "mlp@32"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    doc = json.loads(lines[-1])
    assert (doc["bench"], doc["target"], doc["device"]) == ("gpu_step_time_check", "cpu", "cpu")
    (row,) = doc["cases"]
    assert (row["case"], row["batch"], row["timing_source"]) == ("mlp@32", 32, "cpu_spans")
    assert row["ops_with_device_time"] == row["ops"] > 0
    # Probes at 2 and 4 against a target of 32: forecast() adds a timing probe at 16; both forecasts reported.
    assert row["gpu_probe_forecast_ms"] > 0 and row["gpu_probe_no_reach_forecast_ms"] > 0
    assert row["gpu_probe_forecast_ms"] != row["gpu_probe_no_reach_forecast_ms"]
    assert (row["sparse"]["layers"], row["sparse"]["timed_layers"], row["sparse"]["timed_layers_found"]) == (6, 2, 2)
    header = next(line for line in lines if line.startswith("case ") and "layer sum" in line)
    assert header.split() == ["case", "batch", "measured", "ms", "layer", "sum", "err", "%", "all", "ops", "timed",
                              "ops", "on", "device", "err", "%", "w/o", "half", "err", "%", "CPU", "probes", "err", "%"]
