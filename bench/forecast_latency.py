"""Forecast latency: time spent forecasting (probes excluded) for traces of 10,000 ops and more.

Probes GPT-style decoders of 7 and 12 blocks (each probe trace, two iterations, holds about 11,000 and 19,000
ops), then times MemoryForecaster.run (C++: stream extraction, structure check, fits, replay; for a GPU target
also the caching-allocator simulation and the largest-batch search) over 15 runs per target, each on a fresh
forecaster. The first run of each depth also assembles the probe traces (once per trace, then kept): its time
is reported apart ("first"), the median and max are over all 15. Target: <= 20 ms for a 10,000-op trace.
Last line: {"bench": "forecast_latency", "results": [{"target", "ops_per_probe", "first_ms", "median_ms",
"max_ms", "cpp_median_ms"}]}
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]


def main():
    import torch
    import gpucast
    from examples import zoo
    torch.set_num_threads(1)
    torch.manual_seed(0)
    case = zoo.CASES["gpt"]
    results = []
    print(f"{'target':<12} {'ops/probe':>10} {'first ms':>9} {'median ms':>10} {'max ms':>8} {'C++ ms':>8}")
    for blocks in (7, 12):
        model = zoo.GPT(n_layers=blocks)
        opt = zoo.make_optimizer("adamw", model.parameters())
        step = zoo.make_step(model, opt, case.loss_fn)
        probes = []
        for b in (2, 4, 8):
            batch = case.make_batch(b)
            with gpucast.trace() as t:
                step(batch)
                step(batch)
            probes.append((t.result, b))
        ops = len(probes[-1][0])
        for target in ("cpu", "H100-80GB"):
            walls, inner = [], []
            for _ in range(15):
                f = torch.classes.gpucast.MemoryForecaster()
                for t, b in probes:
                    f.add_probe(t.handle, b)
                t0 = time.perf_counter()
                out = json.loads(f.run(64, target, 0, 0.9, "cpu", "", "", "", [], 0.0, -1, ""))
                walls.append((time.perf_counter() - t0) * 1e3)
                inner.append(out["forecast_ms"])
            row = {"target": target, "ops_per_probe": ops, "first_ms": round(walls[0], 3),
                   "median_ms": round(statistics.median(walls), 3), "max_ms": round(max(walls), 3),
                   "cpp_median_ms": round(statistics.median(inner), 3)}
            results.append(row)
            print(f"{target:<12} {ops:>10} {row['first_ms']:>9.2f} {row['median_ms']:>10.2f} {row['max_ms']:>8.2f} "
                  f"{row['cpp_median_ms']:>8.2f}")
    print(json.dumps({"bench": "forecast_latency", "results": results}))


if __name__ == "__main__":
    sys.exit(main())
