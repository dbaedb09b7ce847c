"""Data-parallel scaling on real A100s: vTrain's measured GPT iterations (../shared/data/vtrain), forecast by
gpucast's step-time model from the run of the same model at the smallest data-parallel degree.

vTrain's ground_truth_single.csv holds 1,440 Megatron-DeepSpeed GPT iterations on 2-8 A100s of one node. For
every group of runs without pipeline parallelism that share the model (hidden size, layers), the micro-batch,
the tensor-parallel degree and the global batch, the run at the smallest data-parallel degree is the probe: its
per-micro-batch compute c = (T - E) / m, where m is its number of micro-batches (gradient accumulation steps)
and E the exposed gradient all-reduce that gpucast forecasts for it. Every other run of the group is then
forecast by torch.ops.gpucast.forecast_step_time (the code behind fc.time): m' micro-batches of c, then the
all-reduce of the gradients (Megatron reduces them after backward: one bucket, exposed) over a ring link fitted
to vTrain's nccl-tests table for that many GPUs (trace/a100/AR_GPU{n}_1M_1024M_LUT). Gradients: fp16, the GPT's
parameters 12 L h^2 + 13 L h + (V + S) h + 2 h with V = 50,304 (GPT-2's vocabulary padded to 128) and S = the
sequence length, divided by the tensor-parallel degree.

Beside it, in the same run: linear scaling (T' = T m' / m, no communication model). vTrain's published error on
one 8xA100 node: 8.37 % (its own per-op profile, not a measured run, as input).
"""
from __future__ import annotations

import csv
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]
VTRAIN = ROOT.parent / "shared" / "data" / "vtrain"
VOCAB = 50304


def link(gpus: int) -> str:
    """The ring link fitted to vTrain's nccl-tests table for `gpus` A100s (neusight_parallel's fit)."""
    from neusight_parallel import a100_link
    alpha, bw = a100_link(gpus)
    return f"alpha_us:{alpha},bytes_per_us:{bw}"


def grad_bytes(h: int, layers: int, seq: int, tp: int) -> int:
    params = 12 * layers * h * h + 13 * layers * h + (VOCAB + seq) * h + 2 * h
    return 2 * params // tp


def step(compute_ms: float, micro: int, grads: int, global_batch: int, dp: int, micro_batches: int,
         link_text: str) -> dict:
    """gpucast's forecast for one rank: one layer holding the model (its gradients ready when backward ends)."""
    import torch
    timing = {"batch": micro, "wall_ns": compute_ms * 1e6, "optimizer_ns": 0.0, "other_ns": 0.0, "clock": "device",
              "layers": [{"layer": "gpt", "forward_ns": compute_ms * 1e6 / 3, "backward_ns": compute_ms * 2e6 / 3,
                          "grad_bytes": grads, "backward_order": 0, "kind": "other", "out_bytes": 0}]}
    text = torch.ops.gpucast.forecast_step_time([json.dumps(timing)], global_batch,
                                                f"dp:{dp},micro_batches:{micro_batches}", link_text if dp > 1 else "")
    return json.loads(text)


def main() -> int:
    import gpucast  # noqa: F401
    path = VTRAIN / "data" / "ground_truth_single.csv"
    if not path.exists():
        print(f"vtrain: {path} not found")
        print(json.dumps({"bench": "vtrain_scaling", "mre_pct": None, "cases": 0}))
        return 0
    groups = defaultdict(list)
    with open(path, encoding="utf-8-sig") as f:
        for r in csv.DictReader(f):
            if r["pipeline parallelism"] != "1":
                continue
            key = tuple(int(r[k]) for k in ("hidden size", "# layers", "sequence length", "micro batch",
                                            "tensor parallelism", "global batch"))
            groups[key].append((int(r["data parallelism"]), float(r["iteration time (ms)"])))
    links = {n: link(n) for n in range(2, 9)}
    errs, linear_errs, rows = [], [], []
    for (h, layers, seq, micro, tp, batch), runs in sorted(groups.items()):
        runs.sort()
        if len(runs) < 2:
            continue
        dp0, t0 = runs[0]
        m0 = batch // (dp0 * micro)
        grads = grad_bytes(h, layers, seq, tp)
        exposed0 = step(1.0, micro, grads, batch, dp0, m0, links.get(dp0, ""))["exposed_comm_ms"]
        c = (t0 - exposed0) / m0
        for dp, t in runs[1:]:
            m = batch // (dp * micro)
            fc = step(c, micro, grads, batch, dp, m, links[dp])
            err = 100.0 * (fc["step_ms"] - t) / t
            lin = 100.0 * (t0 * m / m0 - t) / t
            errs.append(abs(err))
            linear_errs.append(abs(lin))
            rows.append({"hidden": h, "layers": layers, "micro_batch": micro, "tp": tp, "global_batch": batch,
                         "probe_dp": dp0, "probe_ms": t0, "dp": dp, "measured_ms": t,
                         "forecast_ms": round(fc["step_ms"], 3), "exposed_comm_ms": round(fc["exposed_comm_ms"], 3),
                         "err_pct": round(err, 2), "linear_err_pct": round(lin, 2)})
    used = sum(1 for runs in groups.values() if len(runs) > 1)
    print(f"{len(rows)} runs forecast from the smallest-dp run of their group ({used} groups of runs without "
          "pipeline parallelism that differ in the data-parallel degree only)")
    print(f"{'h':>5} {'L':>3} {'mb':>3} {'tp':>3} {'B':>4} {'probe dp/ms':>14} {'dp':>3} {'measured':>9} "
          f"{'forecast':>9} {'comm':>6} {'err %':>7} {'linear %':>8}")
    for r in rows[:: max(1, len(rows) // 25)]:
        print(f"{r['hidden']:>5} {r['layers']:>3} {r['micro_batch']:>3} {r['tp']:>3} {r['global_batch']:>4} "
              f"{r['probe_dp']:>3}/{r['probe_ms']:>9.1f} {r['dp']:>3} {r['measured_ms']:>9.1f} "
              f"{r['forecast_ms']:>9.1f} {r['exposed_comm_ms']:>6.1f} {r['err_pct']:>+7.2f} {r['linear_err_pct']:>+8.2f}")
    mre = statistics.fmean(errs) if errs else None
    lin = statistics.fmean(linear_errs) if linear_errs else None
    if mre is not None:
        print(f"gpucast: mean |error| {mre:.2f} % (median {statistics.median(errs):.2f} %, p90 "
              f"{sorted(errs)[int(0.9 * len(errs))]:.2f} %); linear scaling without communication: {lin:.2f} %; "
              "vTrain's published: 8.37 %")
    print(json.dumps({"bench": "vtrain_scaling", "mre_pct": None if mre is None else round(mre, 3),
                      "linear_mre_pct": None if lin is None else round(lin, 3), "cases": len(rows)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
