"""Distributed memory: each rank's measured peak allocator bytes against gpucast's per-rank forecast.

Each case is bench/pipeline_live.py's GPT-style decoder (an nn.Sequential of blocks), global batch 16, AdamW, 3
training steps, parallelised the way PyTorch's users write it, on 2 or 4 processes of this machine (gloo on
loopback, one thread each):
  ddp, ddp_bucket_view   DistributedDataParallel, gradient_as_bucket_view False / True
  zero1                  ZeroRedundancyOptimizer(AdamW) over DDP
  fsdp, fsdp_x4          FSDP2: fully_shard on every top-level child, then on the root (2 / 4 ranks)
  fsdp_no_reshard        the same with reshard_after_forward=False
  fsdp_reshard_2         reshard_after_forward=2 on 4 ranks
  fsdp_bf16              MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)
  fsdp_ckpt              every block under torch.utils.checkpoint (use_reentrant=False), then FSDP2
  fsdp_ckpt_wrapper      every block under checkpoint_wrapper, then FSDP2
Every rank measures its own peak independently of gpucast (which the ranks never import): torch.profiler's memory
events from before the model is built (after the process group is up), the running sum of the CPU allocator's
allocations and frees, its largest value over the 3 steps (bench/memory_accuracy.py's measurement; blocks matched
by address, because gloo's worker threads free some unseen: see peak_of). Each case runs
--runs times, every time in fresh processes; per rank the min, median and max over the runs are reported. The
forecast comes from this (parent) process: gpucast.forecast(target="cpu") from single-process probes of the same
model and step, with parallel= describing the job (dp, dp_mode "ddp" / "zero1" / "fsdp" with fsdp_units, DDP's
gradient_as_bucket_view). A case the parallel= keys cannot describe yet (reshard_after_forward False or an int,
mixed precision) prints "n/a (not expressible yet)", stays out of the error statistics and has "forecast": null.
Error = (forecast - largest measured peak of the rank over the runs) / that peak; the target: every forecast at or
above that peak and within 1 %, median |error| <= 0.3 %. Tensor parallelism, FSDP x TP and pipelining are listed
as not measured. A run whose rank dies or overruns --timeout is killed, reported, and makes the exit status 1
(--fail-rank R makes rank R exit during step 2, to check that path). Last line: one JSON object.

    python bench/dist_memory.py [--quick] [--cases ddp,fsdp] [--runs 5] [--timeout 300] [--fail-rank R]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.utils.checkpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]

GLOBAL_BATCH = 16
STEPS = 3


@dataclasses.dataclass(frozen=True)
class Case:
    world: int
    strategy: str  # "ddp", "zero1" or "fsdp"
    options: dict  # how the strategy is set up (see wrap())
    forecastable: bool = True  # whether parallel= can describe it yet


CASES = {
    "ddp": Case(2, "ddp", {"gradient_as_bucket_view": False}),
    "ddp_bucket_view": Case(2, "ddp", {"gradient_as_bucket_view": True}),
    "zero1": Case(2, "zero1", {}),
    "fsdp": Case(2, "fsdp", {"reshard_after_forward": True}),
    "fsdp_x4": Case(4, "fsdp", {"reshard_after_forward": True}),
    "fsdp_no_reshard": Case(2, "fsdp", {"reshard_after_forward": False}, forecastable=False),
    "fsdp_reshard_2": Case(4, "fsdp", {"reshard_after_forward": 2}, forecastable=False),
    "fsdp_bf16": Case(2, "fsdp", {"reshard_after_forward": True, "bf16": True}, forecastable=False),
    "fsdp_ckpt": Case(2, "fsdp", {"reshard_after_forward": True, "checkpoint": "utils"}),
    "fsdp_ckpt_wrapper": Case(2, "fsdp", {"reshard_after_forward": True, "checkpoint": "wrapper"}),
}
QUICK = ("ddp", "fsdp")
NOT_MEASURED = {
    "tp": "parallelize_module, ColwiseParallel / RowwiseParallel on attention and MLP, 4 ranks",
    "fsdp_tp": "FSDP x TP on a 2 x 2 mesh, 4 ranks",
    "pp_gpipe": "torch.distributed.pipelining ScheduleGPipe, 2 stages, 4 micro-batches",
    "pp_1f1b": "torch.distributed.pipelining Schedule1F1B, 2 stages, 4 micro-batches",
}


def build(case: Case):
    """(model, make_batch, loss_fn): the GPT-style decoder, its blocks under activation checkpointing if asked."""
    from pipeline_live import make_case
    from examples import zoo

    model, make_batch, loss_fn = make_case("gpt")
    how = case.options.get("checkpoint")
    for i, child in enumerate(model):
        if how and isinstance(child, zoo.Block):
            if how == "utils":
                model[i] = Checkpointed(child)
            else:
                from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
                model[i] = checkpoint_wrapper(child)
    return model, make_batch, loss_fn


class Checkpointed(torch.nn.Module):
    """A block whose activations are recomputed in backward, as users write it with torch.utils.checkpoint."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def wrap(case: Case, model):
    """(module to call, optimizer): the model parallelised as `case` says, on the default process group."""
    from examples import zoo

    if case.strategy == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, gradient_as_bucket_view=case.options["gradient_as_bucket_view"])
        return ddp, zoo.make_optimizer("adamw", ddp.parameters())
    if case.strategy == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    kw = {"mesh": mesh, "reshard_after_forward": case.options["reshard_after_forward"]}
    if case.options.get("bf16"):
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for child in model:
        fully_shard(child, **kw)
    fully_shard(model, **kw)
    return model, zoo.make_optimizer("adamw", model.parameters())


def peak_of(prof) -> dict:
    """The running sum of the CPU allocator's allocations and frees in the profile, and its largest value.

    The profiler sees the allocator only on threads that carry its state: a block that gloo's worker threads free
    after a collective (FSDP2's reduce-scatter input, its all-gather output) shows its allocation and no free. Blocks
    are therefore matched by address: a block whose address is allocated again was freed before that, unseen, and is
    taken off the sum there (the latest it can have been freed: the peak stays an upper bound, and inferred_free_bytes
    says how much was inferred so); a free of a block never seen allocated (held before the profile, or allocated on
    an unseen thread) is not counted (unmatched_free_bytes). A block freed unseen whose address never comes back stays
    in the sum: end_bytes above what the model's states hold at the end shows how much."""
    from torch._C._profiler import _EventType
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    events = []
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            events.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr))
    events.sort(key=lambda a: a[0])
    live, held, peak, inferred, unmatched = {}, 0, 0, 0, 0
    for _, size, ptr in events:
        if size > 0:
            if ptr in live:  # freed unseen before its address came back
                inferred += live[ptr]
                held -= live[ptr]
            live[ptr] = size
            held += size
            peak = max(peak, held)
        elif ptr in live:
            held -= live.pop(ptr)
        else:
            unmatched -= size
    return {"peak_bytes": peak, "end_bytes": held, "inferred_free_bytes": inferred, "unmatched_free_bytes": unmatched}


def worker(args) -> None:
    """One rank: build, parallelise and train the case under torch.profiler; print its peak as JSON."""
    import torch.distributed as dist
    from examples import zoo

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    case = CASES[args.worker]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        model, make_batch, loss_fn = build(case)
        module, opt = wrap(case, model)
        step = zoo.make_step(module, opt, loss_fn)
        for i in range(STEPS):
            if rank == args.fail_rank and i == 1:
                os._exit(3)  # the failure path's check: a rank that dies mid-run
            b = make_batch(GLOBAL_BATCH // world)
            step(b)
            del b
    print(json.dumps({"rank": rank, **peak_of(prof)}), flush=True)
    dist.destroy_process_group()
    sys.stderr.flush()
    os._exit(0)  # as pipeline_live.py: no interpreter teardown in a gloo worker


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(name: str, args) -> tuple[list[dict] | None, str | None]:
    """One run of a case in `world` fresh processes: (each rank's result, None), or (None, why it failed). A rank
    that exits non-zero gets the others 10 s to end before they are killed; the whole run --timeout seconds."""
    world = CASES[name].world
    env0 = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT / 'python'}:{ROOT}")
    argv = [sys.executable, __file__, "--worker", name, "--timeout", str(args.timeout), "--fail-rank",
            str(args.fail_rank)]
    with tempfile.TemporaryDirectory(prefix="dist_memory_") as tmp:
        files = [(open(f"{tmp}/{r}.out", "w+"), open(f"{tmp}/{r}.err", "w+")) for r in range(world)]
        procs = [subprocess.Popen(argv, env=dict(env0, RANK=str(r), LOCAL_RANK=str(r)), stdout=o, stderr=e, text=True)
                 for r, (o, e) in enumerate(files)]
        deadline, why = time.monotonic() + args.timeout, None
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed and why is None:
                why = f"rank {failed[0]} exited with code {procs[failed[0]].returncode}"
                deadline = min(deadline, time.monotonic() + 10)
            if time.monotonic() > deadline:
                late = [r for r, p in enumerate(procs) if p.poll() is None]
                why = why or f"ranks {late} still running after {args.timeout} s"
                for r in late:
                    procs[r].kill()
                    procs[r].wait()
                break
            time.sleep(0.2)
        outs = []
        for o, e in files:
            o.seek(0), e.seek(0)
            outs.append((o.read(), e.read()))
            o.close(), e.close()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if why or failed:
        said = [f"rank {r} exited with code {procs[r].returncode}"
                + (f" ({outs[r][1].strip().splitlines()[-1][:200]})" if outs[r][1].strip() else "") for r in failed]
        return None, "; ".join([why] * (why is not None and not why.startswith("rank ")) + said)
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs], None


def measure(name: str, args) -> dict:
    """--runs runs of a case: per rank the peaks of every run, their min, median and max; failed runs' reasons."""
    keys = ("peak_bytes", "end_bytes", "inferred_free_bytes", "unmatched_free_bytes")
    per_rank = [{k: [] for k in keys} for _ in range(CASES[name].world)]
    errors = []
    for i in range(args.runs):
        res, why = run_once(name, args)
        if why:
            errors.append(why)
            print(f"  {name} run {i + 1}: FAILED: {why}", flush=True)
            continue
        for r in res:
            for k in keys:
                per_rank[r["rank"]][k].append(r[k])
    ranks = []
    for r, runs in enumerate(per_rank):
        p = runs.pop("peak_bytes")
        stats = {"min_bytes": min(p), "median_bytes": int(statistics.median(p)), "max_bytes": max(p)} if p else {}
        ranks.append({"rank": r, "peaks_bytes": p, **stats, **runs})
    return {"runs": args.runs, "failed_runs": errors, "ranks": ranks}


def forecast(name: str) -> tuple[int | None, float]:
    """(gpucast's per-rank peak allocated bytes or None where parallel= cannot describe the case, seconds taken)."""
    import warnings
    import gpucast
    from examples import zoo

    case = CASES[name]
    if not case.forecastable:
        return None, 0.0
    torch.set_num_threads(1)
    model, make_batch, loss_fn = build(case)
    opt = zoo.make_optimizer("adamw", model.parameters())
    step = zoo.make_step(model, opt, loss_fn)
    parallel = {"dp": case.world, "dp_mode": case.strategy}
    if case.strategy == "ddp":
        parallel["gradient_as_bucket_view"] = case.options["gradient_as_bucket_view"]
    if case.strategy == "fsdp":
        parallel["fsdp_units"] = list(model)  # each top-level child a unit, as the ranks wrap them; the root holds none
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a parallel forecast without a link: the step time's concern, not memory's
        fc = gpucast.forecast(step, make_batch, GLOBAL_BATCH, model=model, optimizer=opt, target="cpu",
                              parallel=parallel, timing_rounds=1)
    return fc.memory.peak_allocated_bytes, time.perf_counter() - t0


def describe(case: Case) -> str:
    o = case.options
    if case.strategy == "ddp":
        return f"DDP, gradient_as_bucket_view={o['gradient_as_bucket_view']}"
    if case.strategy == "zero1":
        return "ZeroRedundancyOptimizer over DDP"
    extra = {"utils": ", torch.utils.checkpoint", "wrapper": ", checkpoint_wrapper"}.get(o.get("checkpoint"), "")
    return f"FSDP2, reshard_after_forward={o['reshard_after_forward']}{', bf16/fp32' if o.get('bf16') else ''}{extra}"


def row_of(name: str, measured: dict, fc: int | None, fc_s: float) -> dict:
    """The case's JSON row: measurement, forecast, per rank error against the largest peak of the runs."""
    case = CASES[name]
    row = {"case": name, "strategy": describe(case), "world": case.world, "global_batch": GLOBAL_BATCH,
           "steps": STEPS, "forecast": fc, "forecast_s": round(fc_s, 1), **measured}
    for r in row["ranks"]:
        if fc is not None and r["peaks_bytes"]:
            r["err_pct"] = round(100.0 * (fc - r["max_bytes"]) / r["max_bytes"], 3)
            r["spread_pct"] = round(100.0 * (r["max_bytes"] - r["min_bytes"]) / r["min_bytes"], 3)
    return row


def print_row(row: dict) -> None:
    mib = 2 ** 20
    fc = f"{row['forecast'] / mib:.3f}" if row["forecast"] is not None else (
        "failed" if "forecast_error" in row else "n/a (not expressible yet)")
    for r in row["ranks"]:
        if not r["peaks_bytes"]:
            print(f"{row['case']:<18} {row['world']:>2} {r['rank']:>4}  no run finished", flush=True)
            continue
        err = f"{r['err_pct']:+.3f}" if "err_pct" in r else "—"
        print(f"{row['case']:<18} {row['world']:>2} {r['rank']:>4} {r['min_bytes'] / mib:>9.3f} "
              f"{r['median_bytes'] / mib:>9.3f} {r['max_bytes'] / mib:>9.3f} {len(r['peaks_bytes']):>4} {fc:>13} "
              f"{err:>8}   {row['strategy']}", flush=True)


def summary(rows: list[dict]) -> dict:
    try:
        import gpucast
        version = gpucast.__version__
    except Exception as e:  # noqa: BLE001 - the library missing: already reported as failed forecasts
        version = f"not loaded ({type(e).__name__})"
    errs = [r["err_pct"] for row in rows for r in row["ranks"] if "err_pct" in r]
    abs_errs = [abs(e) for e in errs]
    return {"bench": "dist_memory", "schema_version": 1,
            "context": {"gpucast": version, "torch": torch.__version__, "device": "cpu",
                        "date": datetime.date.today().isoformat()},
            "median_abs_err_pct": round(statistics.median(abs_errs), 3) if errs else None,
            "max_abs_err_pct": round(max(abs_errs), 3) if errs else None,
            "underestimates": sum(1 for e in errs if e < 0), "compared_ranks": len(errs),
            "failed_runs": sum(len(row["failed_runs"]) for row in rows),
            "failed_forecasts": sum(1 for row in rows if "forecast_error" in row),
            "not_measured": [{"case": k, "strategy": v} for k, v in NOT_MEASURED.items()], "cases": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK)} only, 3 runs each")
    ap.add_argument("--runs", type=int, default=5, help="fresh-process runs per case")
    ap.add_argument("--timeout", type=int, default=300, help="seconds one run may take before its ranks are killed")
    ap.add_argument("--fail-rank", type=int, default=-1, help="this rank exits during step 2 (checks the failure path)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    names = list(QUICK) if args.quick else args.cases.split(",")
    if args.quick:
        args.runs = 3
    unknown = [n for n in names if n not in CASES]
    if unknown or args.runs < 1:
        ap.error(f"unknown cases {unknown}; valid: {', '.join(CASES)}" if unknown else "--runs must be at least 1")
    print(f"{'case':<18} {'ws':>2} {'rank':>4} {'min MiB':>9} {'med MiB':>9} {'max MiB':>9} {'runs':>4} "
          f"{'forecast MiB':>13} {'err %':>8}   strategy", flush=True)
    rows = []
    for name in names:
        measured = measure(name, args)
        try:
            fc, fc_s = forecast(name)
        except Exception as e:  # noqa: BLE001 - a forecast that fails is reported beside the measurement
            fc, fc_s, measured["forecast_error"] = None, 0.0, f"{type(e).__name__}: {e}"[:300]
            print(f"  {name}: forecast failed: {measured['forecast_error']}", flush=True)
        rows.append(row_of(name, measured, fc, fc_s))
        print_row(rows[-1])
    for k, v in NOT_MEASURED.items():
        print(f"{k:<18} not measured: {v}")
    out = summary(rows)
    print(f"median |error| {out['median_abs_err_pct']} %, max {out['max_abs_err_pct']} % over "
          f"{out['compared_ranks']} ranks; under-estimates: {out['underestimates']}; "
          f"failed runs: {out['failed_runs']}; failed forecasts: {out['failed_forecasts']}")
    print(json.dumps(out))
    return 1 if out["failed_runs"] or out["failed_forecasts"] else 0


if __name__ == "__main__":
    sys.exit(main())
