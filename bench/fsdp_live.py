"""FSDP on the real engine: gpucast's FSDP (ZeRO-3) forecast against measured FSDP2 steps.

N processes on this machine (--world, default 2), gloo on loopback, one thread each. Each case is a model built
as an nn.Sequential of blocks (bench/pipeline_live.py's: a deep MLP; a GPT-style decoder), sharded the way
PyTorch's FSDP2 documentation does it: fully_shard on every top-level child (a unit each), then on the whole
model (the root unit: what no child holds). Rank 0 forecasts the sharded step (gpucast.forecast(...,
parallel=dict(dp=N, dp_mode="fsdp", fsdp_units=...)), target "cpu") from single-process probes of the whole model
at the per-rank batch plus gpucast.calibrate() on the live group; beside it the same probes' forecast with every
layer that holds parameters its own unit (fsdp_units not given: the finest wrapping). Every rank then times
--iterations FSDP2 steps (AdamW) after 3 warm-up steps; per iteration the slowest rank's time counts, the median
over the iterations is the measured step, with its interquartile range; beside it the same model unsharded, as
many steps on every rank at once, half before the sharded steps and half after (the compute the forecast's
compute is compared with). Beside the forecast: the same probes' forecast without FSDP's own work (its hooks,
copies into and out of the gathered buffers, the optimizer over sharded tensors, which calibrate() measures on
small models: the fsdp_overhead_* keys); and the same steps on one process, whose collectives move nothing,
measure what FSDP2 adds beside them for these models. The whole run is
repeated --repeats times in fresh processes (the machine is shared); per case the repeat with the median error is
kept and every repeat's error printed beside it. No target: the issue's distributed target is DDP's
(bench/step_time_accuracy.py); this checks the FSDP model, which no other measurement reaches. Last line: one JSON
object.

    python bench/fsdp_live.py [--cases mlp,gpt] [--world 2] [--iterations 20] [--repeats 3]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]

from pipeline_live import make_case  # noqa: E402  the models, cut-able between top-level children
from step_time_accuracy import launch_ranks, median_repeats, summary  # noqa: E402  the DDP bench's helpers

BATCH = {"mlp": 128, "gpt": 32}  # global: 64 and 16 samples per rank with 2 ranks


def timed_steps(step, batch, n: int) -> list[float]:
    """n steps after 3 warm-up ones, each step's ms (every rank the same count: collectives pair up)."""
    ts = []
    for i in range(3 + n):
        t0 = time.perf_counter()
        step(batch)
        if i >= 3:
            ts.append((time.perf_counter() - t0) * 1e3)
    return ts


def slowest_rank(ts: list[float], world: int) -> list[float]:
    """Per iteration, the largest of the ranks' step times (every rank's list gathered)."""
    import torch
    import torch.distributed as dist
    every = [torch.zeros(len(ts), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(every, torch.tensor(ts, dtype=torch.float64))
    return [max(e[i].item() for e in every) for i in range(len(ts))]


def worker(args):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import gpucast
    from examples import zoo

    torch.set_num_threads(1)
    torch.ops.gpucast.settle_c_allocator()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name in args.cases.split(","):
        batch = BATCH[name] * world // args.of_world  # the main run's per-rank batch on every rank
        per_rank = batch // world
        row = {"case": name, "world": world, "batch": batch}
        link = gpucast.calibrate() if world > 1 else None
        if rank == 0 and world > 1:
            model, make_batch, loss_fn = make_case(name)
            opt = zoo.make_optimizer("adamw", model.parameters())
            step = zoo.make_step(model, opt, loss_fn)
            units = list(model)  # each top-level child a unit, as the measured run wraps them
            fc = gpucast.forecast(step, make_batch, batch, model=model, optimizer=opt, target="cpu",
                                  parallel=dict(dp=world, dp_mode="fsdp", fsdp_units=units), link=link)
            t = fc.time
            fine = fc.step_time(batch, parallel=dict(dp=world, dp_mode="fsdp"), link=link)
            # Without FSDP's own work (calibrate()'s fsdp_overhead_* keys): what that part of the model adds.
            bare = fc.step_time(batch, parallel=dict(dp=world, dp_mode="fsdp", fsdp_units=units),
                                link={k: v for k, v in link.items() if not k.startswith("fsdp_overhead")})
            gathers = sum(1 for c in t.comm if c["kind"] == "fsdp_all_gather")
            row.update(forecast_ms=t.step_ms, compute_ms=t.compute_ms, exposed_comm_ms=t.exposed_comm_ms,
                       comm_ms=t.comm_ms, gathers=gathers, every_layer_forecast_ms=fine.step_ms,
                       every_layer_gathers=sum(1 for c in fine.comm if c["kind"] == "fsdp_all_gather"),
                       own_work_ms=t.step_ms - bare.step_ms, no_own_work_forecast_ms=bare.step_ms)
            del model, opt, step, fc
        box = [row]
        dist.broadcast_object_list(box, src=0)
        row = box[0]
        # The plain module on every rank at once (no collectives): the compute the forecast prices.
        model, make_batch, loss_fn = make_case(name)
        data = make_batch(per_rank)
        opt = zoo.make_optimizer("adamw", model.parameters())
        plain_step = zoo.make_step(model, opt, loss_fn)
        dist.barrier()
        plain = timed_steps(plain_step, data, args.iterations // 2)  # half before the sharded steps, half after
        sharded, _, _ = make_case(name)
        for child in sharded:
            fully_shard(child, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        sharded_opt = zoo.make_optimizer("adamw", sharded.parameters())
        dist.barrier()
        steps = slowest_rank(timed_steps(zoo.make_step(sharded, sharded_opt, loss_fn), data, args.iterations), world)
        dist.barrier()
        plain = slowest_rank(plain + timed_steps(plain_step, data, args.iterations - args.iterations // 2), world)
        if rank == 0 and world == 1:
            med, iqr = summary(steps)
            plain_ms, _ = summary(plain)
            row.update(measured_ms=round(med, 3), iqr_ms=round(iqr, 3), plain_ms=round(plain_ms, 3),
                       fsdp_extra_ms=round(med - plain_ms, 3), err_pct=0.0)
            out[name] = row
        elif rank == 0:
            med, iqr = summary(steps)
            plain_ms, _ = summary(plain)
            row.update(measured_ms=round(med, 3), iqr_ms=round(iqr, 3), plain_ms=round(plain_ms, 3),
                       err_pct=round(100.0 * (row["forecast_ms"] - med) / med, 2),
                       every_layer_err_pct=round(100.0 * (row["every_layer_forecast_ms"] - med) / med, 2),
                       no_own_work_err_pct=round(100.0 * (row["no_own_work_forecast_ms"] - med) / med, 2),
                       compute_err_pct=round(100.0 * (row["compute_ms"] - row["own_work_ms"] - plain_ms) / plain_ms,
                                             2),
                       fsdp_extra_ms=round(med - plain_ms, 3), link=link)
            for k in ("forecast_ms", "compute_ms", "exposed_comm_ms", "comm_ms", "every_layer_forecast_ms",
                      "own_work_ms", "no_own_work_forecast_ms"):
                row[k] = round(row[k], 3)
            out[name] = row
        del model, opt, plain_step, sharded, sharded_opt
        dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(out), flush=True)
    sys.stderr.flush()
    os._exit(0)  # as pipeline_live.py: no interpreter teardown in a gloo worker


def run(args, world: int) -> list[dict]:
    res = launch_ranks(__file__, ["--worker", "--cases", args.cases, "--iterations", str(args.iterations),
                                  "--of-world", str(args.world)], world, 29547, "FSDP")
    return [res[n] for n in args.cases.split(",")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="mlp,gpt")
    ap.add_argument("--world", type=int, default=2, help="data-parallel ranks, one process each")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--of-world", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    rows = median_repeats([run(args, args.world) for _ in range(args.repeats)])
    # FSDP2's own work beside its collectives (hooks, copies in and out of the gathered buffers, the optimizer over
    # sharded tensors): the same steps on one rank, whose collectives move nothing; the median of the repeats.
    alone = [run(args, 1) for _ in range(args.repeats)]
    for i, row in enumerate(rows):
        extra = sorted(r[i]["fsdp_extra_ms"] for r in alone)
        row["one_rank_fsdp_extra_ms"] = extra[len(extra) // 2]
    for row in rows:
        print(f"FSDP x{row['world']} {row['case']:<5} batch {row['batch']:>4}: measured {row['measured_ms']:.2f} ms "
              f"(IQR {row['iqr_ms']:.2f}; unsharded {row['plain_ms']:.2f}, FSDP adds {row['fsdp_extra_ms']:.2f}), "
              f"forecast {row['forecast_ms']:.2f} ms (compute {row['compute_ms']:.2f}, FSDP's own work aside "
              f"{row['compute_err_pct']:+.1f} % against the unsharded steps; exposed communication {row['exposed_comm_ms']:.2f} of "
              f"{row['comm_ms']:.2f}; {row['gathers']} all-gathers), error {row['err_pct']:+.2f} % (median of "
              f"{len(row['repeat_err_pct'])} runs: {', '.join(f'{e:+.2f}' for e in row['repeat_err_pct'])}); "
              f"every layer a unit: {row['every_layer_forecast_ms']:.2f} ms ({row['every_layer_gathers']} all-gathers), "
              f"{row['every_layer_err_pct']:+.2f} %; FSDP's own work in the forecast {row['own_work_ms']:.2f} ms "
              f"(without it {row['no_own_work_err_pct']:+.2f} %), FSDP2 on one process adds "
              f"{row['one_rank_fsdp_extra_ms']:.2f} ms to the unsharded step", flush=True)
    mre = statistics.mean(abs(r["err_pct"]) for r in rows)
    fine = statistics.mean(abs(r["every_layer_err_pct"]) for r in rows)
    bare = statistics.mean(abs(r["no_own_work_err_pct"]) for r in rows)
    print(f"mean |error| {mre:.2f} % over {len(rows)} cases (every layer a unit: {fine:.2f} %; without FSDP's own "
          f"work: {bare:.2f} %)")
    print(json.dumps({"bench": "fsdp_live", "world": args.world, "mre_pct": round(mre, 2),
                      "every_layer_mre_pct": round(fine, 2), "no_own_work_mre_pct": round(bare, 2), "cases": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
