"""The examples' command line (examples/zoo.py run_example, what `make demo` runs): trace, forecasts, errors."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def example(name: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'python'}:{ROOT}")
    return subprocess.run([sys.executable, str(ROOT / "examples" / f"{name}.py"), *args], env=env,
                          capture_output=True, text=True, timeout=600)


def test_the_example_traces_forecasts_on_this_cpu_measures_and_forecasts_a_gpu_run():
    out = example("mlp", "--batch-size", "8", "--forecast-batch", "16", "--target", "H100-80GB", "--dp", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for i, line in enumerate(lines[:3], 1):
        assert re.fullmatch(rf"step {i} loss \d+\.\d{{4}}{' [(]traced[)]' if i == 2 else ''}", line), line
    assert lines[3].startswith("gpucast trace: ")
    cpu = lines.index("gpucast.forecast: batch 16 on this CPU (1 thread(s)), from probes at small batches")
    assert lines[cpu + 1] == "gpucast forecast for cpu, batch 16:"
    assert re.fullmatch(r"  step time [\d,.]+ ms: compute .*", next(l for l in lines[cpu:] if l.startswith("  step time")))
    measured = [l for l in lines if l.startswith("measured: ")]
    assert len(measured) == 1
    assert re.fullmatch(r"measured: the step at batch 16 takes [\d,.]+ ms \(median of 10 steps, [\d,.]+-[\d,.]+\); "
                        r"forecast [\d,.]+ ms, [+-]\d+\.\d %", measured[0]), measured[0]
    gpu = lines.index("gpucast.forecast: batch 32 on H100-80GB with 2 data-parallel ranks, from probes on this CPU")
    assert lines[gpu + 1] == "gpucast forecast for H100-80GB, batch 32 (16 per rank):"
    assert gpu > lines.index(measured[0])
    # Notes show their first line only; the layer models' rates per kind stay in fc.time.notes.
    assert not any(l.startswith("  matmul ") for l in lines)


def test_the_example_without_forecasts_and_its_bad_arguments():
    out = example("mlp", "--batch-size", "4", "--forecast-batch", "0")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "gpucast.forecast" not in out.stdout and "gpucast trace: " in out.stdout
    bad = example("mlp", "--dp", "0")
    assert bad.returncode == 2
    assert bad.stderr.splitlines()[-1].endswith("error: --forecast-batch must be at least 0 and --dp at least 1")
