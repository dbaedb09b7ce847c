"""The golden forecasts: every forecast gpucast makes from committed inputs, as plain values.

Inputs (committed, never re-recorded by the test):
- tests/data/golden/probes/<case>_<batch>.json.gz: CPU probe traces of zoo and real cases (record_inputs.py);
- tests/data/gpu_probes/<case>_<n>.json.gz: probes traced on an H200 (bench/gpu/run.sh);
- tests/data/gpu_timings_cnn.json: GPU probe timings recorded without device timers;
- bench/dataset/step_times*.jsonl.gz: the step-time recordings (the graph network's input graphs).

Outputs: the memory forecast (every field of MemoryForecast) and the step-time forecast (every field of
TimeForecast, the timeline's spans included) for each case and setting, and the graph network's correction of each
recorded graph. The graph network's global features are this CPU's measured rates in a live forecast; here they
are fixed (FIXED_RATES) so that the forecast is a function of the committed inputs alone.

    PYTHONPATH=python:. .venv/bin/python tests/golden/golden_cases.py --write   # store the expected values
"""
from __future__ import annotations

import gzip
import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
PROBES = DATA / "golden" / "probes"
EXPECTED = DATA / "golden" / "expected.json.gz"
RECORDINGS = ("step_times.jsonl.gz", "step_times_2.jsonl.gz", "step_times_3.jsonl.gz", "step_times_4.jsonl.gz")

# The CPU probes: zoo cases and real architectures, AdamW, at the forecast's default probe sizes.
ZOO_CASES = ("mlp", "cnn", "lstm", "gpt", "resnet18", "bert", "gpt2")
PROBE_BATCHES = (2, 4, 8)
GPU_CASES = {"mlp": 256, "gpt": 32, "resnet18": 32, "cnn": 64}  # tests/data/gpu_probes and their target batches
FIXED_RATES = {"peak_gflops": 100.0, "mem_gbps": 50.0}

# A link given as calibrate() returns it (two ranks' samples) and as a topology.
LINK_MEASURED = {"alpha_us": 35.0, "bytes_per_us": 1200.0, "ranks": 2,
                 "samples": [{"bytes": 65536, "us": 90.0}, {"bytes": 1048576, "us": 900.0},
                             {"bytes": 16777216, "us": 14000.0}],
                 "send_samples": [{"bytes": 65536, "us": 40.0}, {"bytes": 4194304, "us": 2100.0}]}
LINK_TOPOLOGY = "intra:nvlink4,gpus_per_node:8,inter:ib-ndr"

# Memory settings: (name, target, batch, parallel, PYTORCH_ALLOC_CONF, capacity bytes).
MEMORY_SETTINGS = (
    ("cpu", "cpu", 32, {}, "", 0),
    ("h100", "H100-80GB", 64, {}, "", 0),
    ("h100_capacity", "H100-80GB", 64, {}, "", 2 << 30),
    ("h100_ddp2", "H100-80GB", 64, {"dp": 2}, "", 0),
    ("h100_zero1_4", "H100-80GB", 64, {"dp": 4, "dp_mode": "zero1"}, "", 0),
    ("h100_zero2_4", "H100-80GB", 64, {"dp": 4, "dp_mode": "zero2"}, "", 0),
    ("h100_fsdp4", "H100-80GB", 64, {"dp": 4, "dp_mode": "fsdp"}, "", 0),
    ("h100_tp2_pp2", "H100-80GB", 64, {"tp": 2, "pp": 2, "micro_batches": 4}, "", 0),
    ("h100_expandable", "H100-80GB", 64, {}, "expandable_segments:True", 0),
    ("h100_split", "H100-80GB", 64, {}, "max_split_size_mb:64,garbage_collection_threshold:0.6", 0),
    ("h100_roundup", "H100-80GB", 64, {}, "roundup_power2_divisions:4", 0),
)

# FSDP2 with its units (the zoo GPT's blocks; the root keeps the embeddings, final LayerNorm and head), per case.
_GPT_BLOCKS = "|".join(f"GPT.blocks.{i}" for i in range(2))
FSDP_UNIT_SETTINGS = {
    "gpt": (
        ("cpu_fsdp2_units", "cpu", 32, {"dp": 2, "dp_mode": "fsdp", "fsdp_units": _GPT_BLOCKS}, "", 0),
        ("h100_fsdp4_units_keep", "H100-80GB", 64,
         {"dp": 4, "dp_mode": "fsdp", "fsdp_units": _GPT_BLOCKS, "reshard_after_forward": False}, "", 0),
        ("h100_fsdp4_units_to2", "H100-80GB", 64,
         {"dp": 4, "dp_mode": "fsdp", "fsdp_units": _GPT_BLOCKS, "reshard_after_forward": 2}, "", 0),
    ),
}

# Step-time settings: (name, target, batch, parallel, link, extra step_time() arguments).
TIME_SETTINGS = (
    ("cpu", "cpu", 32, {}, None, {}),
    ("cpu_nognn", "cpu", 32, {}, None, {"gnn": None}),
    ("cpu_b128", "cpu", 128, {}, None, {}),
    ("cpu_sparse", "cpu", 32, {}, None, {"time_fraction": 0.5}),
    ("cpu_budget_random", "cpu", 32, {}, None, {"time_budget": 0.5, "design": "random"}),
    ("cpu_ddp2", "cpu", 64, {"dp": 2}, LINK_MEASURED, {}),
    ("cpu_ddp2_bucket", "cpu", 64, {"dp": 2, "bucket_cap_mb": 1, "gradient_as_bucket_view": True}, LINK_MEASURED, {}),
    ("cpu_zero2", "cpu", 64, {"dp": 2, "dp_mode": "zero2"}, LINK_MEASURED, {}),
    ("cpu_fsdp2", "cpu", 64, {"dp": 2, "dp_mode": "fsdp"}, LINK_MEASURED, {}),
    ("cpu_tp2", "cpu", 64, {"tp": 2}, LINK_MEASURED, {}),
    ("cpu_pp2", "cpu", 64, {"pp": 2, "micro_batches": 4}, LINK_MEASURED, {}),
    ("h100", "H100-80GB", 64, {}, None, {}),
    ("h100_ddp8", "H100-80GB", 512, {"dp": 8}, None, {}),
    ("h100_fsdp16", "H100-80GB", 512, {"dp": 16, "dp_mode": "fsdp"}, LINK_TOPOLOGY, {}),
    ("h100_tp2_pp2", "H100-80GB", 256, {"dp": 2, "tp": 2, "pp": 2, "micro_batches": 4}, LINK_TOPOLOGY, {}),
)


def _gz_text(path: Path) -> str:
    return gzip.decompress(path.read_bytes()).decode()


def _traces(case: str, gpu: bool) -> list:
    import torch
    if gpu:
        files = [(DATA / "gpu_probes" / f"{case}_{n}.json.gz", b) for n, b in enumerate(PROBE_BATCHES)]
    else:
        files = [(PROBES / f"{case}_{b}.json.gz", b) for b in PROBE_BATCHES]
    return [(torch.ops.gpucast.trace_from_json(_gz_text(f)), b) for f, b in files]


def _memory(traces: list, target: str, batch: int, parallel: dict, alloc_conf: str, capacity: int,
            probe_device: str) -> dict:
    import torch
    from gpucast import _results, _settings
    f = torch.classes.gpucast.MemoryForecaster()
    for handle, b in traces:
        f.add_probe(handle, b)
    text = f.run(target_batch=batch, target=target, capacity_bytes=capacity, probe_device=probe_device,
                 parallel=_settings._format_parallel(parallel), alloc_conf=alloc_conf)
    out = dict(_results.MemoryForecast(**json.loads(text)).__dict__)
    del out["forecast_ms"]  # how long the forecast took to compute: a timing of this machine, not a forecast
    return out


def _time(fc, name: str, batch: int, parallel: dict, link, extra: dict) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tf = fc.step_time(batch, parallel=parallel, link=link, **extra)
    out = dict(tf.__dict__)
    out["python_warnings"] = [str(w.message) for w in caught]
    return out


def _time_forecast(timings: list, target: str, probe_device: str):
    """A Forecast holding only the probes' timings, as gpucast.forecast() leaves them: step_time() from there."""
    from gpucast import _forecast, _results
    with warnings.catch_warnings():  # what step_time() warns of is recorded with each setting
        warnings.simplefilter("ignore")
        tf = _forecast._forecast_time(timings, 32, target, probe_device, {}, None, gnn=None)
    memory = _results.MemoryForecast(**{k: 0 for k in _results.MemoryForecast.__dataclass_fields__
                                         if k not in ("warnings", "notes", "forecast_ms")} | {
        "target": target, "fragmentation": 0.0, "breakdown": {}, "peak_phase": "", "peak_op": "",
        "peak_module": "", "scaled": False})
    return _results.Forecast(memory=memory, probe_batch_sizes=PROBE_BATCHES, probe_device=probe_device,
                              context={}, time=tf, timings=timings, target=target, optimizer_name="adamw")


def compute() -> dict:
    """Every golden forecast, keyed by case and setting."""
    import torch
    from gpucast import _settings
    saved_rates = dict(_settings._RATES)
    _settings._RATES.clear()
    _settings._RATES.update(FIXED_RATES)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a global feature of the graph network
    try:
        return _compute()
    finally:
        _settings._RATES.clear()
        _settings._RATES.update(saved_rates)
        torch.set_num_threads(threads)


def _compute() -> dict:
    import torch
    out: dict = {"memory": {}, "time": {}, "gnn": {}}
    for case in ZOO_CASES:
        traces = _traces(case, gpu=False)
        for name, target, batch, parallel, conf, cap in MEMORY_SETTINGS + FSDP_UNIT_SETTINGS.get(case, ()):
            out["memory"][f"{case}/{name}"] = _memory(traces, target, batch, parallel, conf, cap, "cpu")
        timings = [h.iteration_timing(b) for h, b in traces]
        for target in ("cpu", "H100-80GB"):
            fc = _time_forecast(timings, target, "cpu")
            for name, t, batch, parallel, link, extra in TIME_SETTINGS:
                if t == target:
                    out["time"][f"{case}/{name}"] = _time(fc, name, batch, parallel, link, extra)
    for case, batch in GPU_CASES.items():
        traces = _traces(case, gpu=True)
        for name, parallel in (("h200", {}), ("h200_fsdp4", {"dp": 4, "dp_mode": "fsdp"})):
            out["memory"][f"gpu_{case}/{name}"] = _memory(traces, "H200-141GB", batch, parallel, "", 0, "cuda:0")
        timings = [h.iteration_timing(b) for h, b in traces]
        fc = _time_forecast(timings, "H200-141GB", "cuda:0")
        out["time"][f"gpu_{case}/h200"] = _time(fc, "h200", batch, {}, None, {})
        out["time"][f"gpu_{case}/h200_ddp8"] = _time(fc, "h200_ddp8", 8 * batch, {"dp": 8}, None, {})
    recorded = json.loads((DATA / "gpu_timings_cnn.json").read_text())
    timings = recorded["timings"] if isinstance(recorded, dict) else recorded
    fc = _time_forecast([t if isinstance(t, str) else json.dumps(t) for t in timings], "H200-141GB", "cuda:0")
    out["time"]["gpu_timings_cnn/h200"] = _time(fc, "h200", 64, {}, None, {})
    for rec in RECORDINGS:
        for i, line in enumerate(_gz_text(ROOT / "bench" / "dataset" / rec).splitlines()):
            graph = json.loads(line)
            out["gnn"][f"{rec}/{i}"] = json.loads(torch.ops.gpucast.step_correction(json.dumps(graph), ""))
    return out


def normalised(value):
    """value through JSON (tuples become lists), as the stored expected values are read back."""
    return json.loads(json.dumps(value))


def main(argv: list[str]) -> int:
    sys.path[:0] = [str(ROOT), str(ROOT / "python")]
    import gpucast  # noqa: F401  (loads the library)
    if argv != ["--write"]:
        print(__doc__)
        return 2
    values = compute()
    EXPECTED.parent.mkdir(parents=True, exist_ok=True)
    EXPECTED.write_bytes(gzip.compress(json.dumps(values, sort_keys=True).encode(), mtime=0))
    print(f"{EXPECTED}: {sum(len(v) for v in values.values())} forecasts "
          f"({', '.join(f'{k} {len(v)}' for k, v in values.items())})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
