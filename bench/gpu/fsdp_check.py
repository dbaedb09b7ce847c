"""FSDP2 on one GPU: the memory forecast's FSDP2 rule against a real fully_shard run of one rank (NCCL, world size 1).

The zoo's GPT-style decoder of bench/pipeline_live.py (an nn.Sequential), fully_shard on every top-level child and
then on the root, AdamW, 3 steps at --batch; torch.cuda.max_memory_allocated() / max_memory_reserved() from before
the model is built (the peak statistics reset after the process group is up). The forecast: gpucast.forecast with
probes on the same GPU and parallel=dict(dp=1, dp_mode="fsdp", fsdp_units=the children). One rank runs FSDP2's
world-size-1 path (no all-gather output: the copy-out reads the shards); NCCL's own buffers are outside the caching
allocator. Prints a table and a final JSON line {"bench": "fsdp_check", ...}. Needs a CUDA GPU.

    python bench/gpu/fsdp_check.py [--batch 16] [--target H100-80GB]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "python"), str(ROOT / "bench")]
STEPS = 3


def build(device: str):
    from pipeline_live import make_case
    model, make_batch, loss_fn = make_case("gpt")
    model = model.to(device)

    def batch_on(n):
        return tuple(t.to(device) for t in make_batch(n))

    return model, batch_on, loss_fn


def measure(batch: int) -> dict:
    """One rank of fully_shard (NCCL): the peaks from before the model is built."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from examples import zoo
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    model, make_batch, loss_fn = build("cuda")
    mesh = init_device_mesh("cuda", (1,))
    for child in model:
        fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = zoo.make_optimizer("adamw", model.parameters())
    step = zoo.make_step(model, opt, loss_fn)
    for _ in range(STEPS):
        step(make_batch(batch))
    torch.cuda.synchronize()
    out = {"peak_allocated_bytes": torch.cuda.max_memory_allocated() - start,
           "peak_reserved_bytes": torch.cuda.max_memory_reserved()}
    dist.destroy_process_group()
    del model, opt
    torch.cuda.empty_cache()
    return out


def forecast(batch: int, target: str) -> dict:
    import gpucast
    from examples import zoo
    model, make_batch, loss_fn = build("cuda")
    opt = zoo.make_optimizer("adamw", model.parameters())
    step = zoo.make_step(model, opt, loss_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fc = gpucast.forecast(step, make_batch, batch, model=model, optimizer=opt, target=target,
                              parallel={"dp": 1, "dp_mode": "fsdp", "fsdp_units": list(model)}, timing_rounds=1)
    m = fc.memory
    return {"peak_allocated_bytes": m.peak_allocated_bytes, "peak_reserved_bytes": m.peak_reserved_bytes,
            "notes": [n["code"] for n in m.notes]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--target", default="H100-80GB")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("fsdp_check: no CUDA GPU here", file=sys.stderr)
        return 2
    fc = forecast(args.batch, args.target)  # first: its probes leave nothing behind the measured run counts
    got = measure(args.batch)
    rows = []
    for k in ("peak_allocated_bytes", "peak_reserved_bytes"):
        err = 100.0 * (fc[k] - got[k]) / got[k]
        rows.append({"quantity": k, "measured": got[k], "forecast": fc[k], "err_pct": round(err, 3)})
        print(f"{k:<22} measured {got[k]:>12} forecast {fc[k]:>12} error {err:+.3f} %")
    print(json.dumps({"bench": "fsdp_check", "target": args.target, "batch": args.batch, "rows": rows,
                      "notes": fc["notes"], "torch": torch.__version__, "device": torch.cuda.get_device_name(0)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
