"""Step-time forecast accuracy on this machine.

CPU, one process: for the zoo and real architectures (torchvision, timm, transformers; random weights, AdamW, one
thread), gpucast.forecast(target="cpu") forecasts the step time at a target batch from traced probes at batch 2, 4
and 8; then the real step is measured in the same process (3 warm-up iterations, then the median of --iterations,
with its interquartile range). Every layer of the probes is timed (sparse timing is not built yet).

Distributed (--ddp N): torchrun-style N processes on this machine, DDP over gloo on loopback, one thread each. Rank
0 forecasts the DDP step from a single-process trace of the model plus gpucast.calibrate() on the live group; then
every rank measures the real DDP step (median of --iterations).

NeuSight's 4-GPU measurements: bench/neusight_parallel.py (dp4 forecast; tp4 / pp4 not modelled yet).
Signed error = (forecast - measured) / measured. Last line: one JSON object (cpu_ood_mre_pct is null: no graph
network is trained yet, so there is no held-out family to speak of).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]

CASES = {"mlp": 256, "cnn": 32, "lstm": 32, "gpt": 16, "resnet18": 16, "mobilenet_v3_small": 16, "bert": 16,
         "gpt2": 16, "vit_tiny": 16, "convnext_atto": 16}


def build(name):
    import torch
    from examples import zoo
    torch.manual_seed(0)
    cases = dict(zoo.CASES)
    cases.update(zoo.real_cases())
    case = cases[name]
    model = case.make_model()
    opt = zoo.make_optimizer("adamw", model.parameters())
    return case, model, opt, zoo.make_step(model, opt, case.loss_fn)


def measure(step, batch, iterations):
    for _ in range(3):
        step(batch)
    ts = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        step(batch)
        ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    q = statistics.quantiles(ts, n=4)
    return statistics.median(ts), q[2] - q[0]


def cpu_cases(names, iterations):
    import torch
    import gpucast
    torch.set_num_threads(1)
    rows = []
    print(f"{'case':<20} {'batch':>5} {'measured ms':>12} {'IQR':>6} {'forecast ms':>12} {'err %':>7}")
    for name in names:
        batch = CASES[name]
        case, model, opt, step = build(name)
        fc = gpucast.forecast(step, case.make_batch, batch, model=model, optimizer=opt, target="cpu")
        measured, iqr = measure(step, case.make_batch(batch), iterations)
        err = 100.0 * (fc.time.step_ms - measured) / measured
        rows.append({"case": name, "batch": batch, "measured_ms": round(measured, 3), "iqr_ms": round(iqr, 3),
                     "forecast_ms": round(fc.time.step_ms, 3), "err_pct": round(err, 2),
                     "layers": len(fc.time.per_layer)})
        print(f"{name:<20} {batch:>5} {measured:>12.2f} {iqr:>6.2f} {fc.time.step_ms:>12.2f} {err:>+7.2f}")
    return rows


def ddp_worker(args):
    """One rank of the DDP run (started by ddp_cases with RANK / WORLD_SIZE / MASTER_* set)."""
    import datetime
    import torch
    import torch.distributed as dist
    import gpucast
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in args.ddp_cases.split(","):
        batch = CASES[name] * world  # global batch: the single-process batch per rank
        case, model, opt, step = build(name)
        link = gpucast.calibrate()
        fc_ms = None
        if rank == 0:
            fc = gpucast.forecast(step, case.make_batch, batch, model=model, optimizer=opt, target="cpu",
                                  parallel=dict(dp=world), link=link)
            fc_ms = (fc.time.step_ms, fc.time.compute_ms, fc.time.exposed_comm_ms, fc.time.comm_ms)
        dist.barrier()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        from examples import zoo
        dstep = zoo.make_step(ddp, opt, case.loss_fn)
        measured, iqr = measure(dstep, case.make_batch(batch // world), args.iterations)
        t = torch.tensor([measured])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank ends
        if rank == 0:
            out[name] = {"case": name, "world": world, "global_batch": batch, "measured_ms": round(t.item(), 3),
                         "iqr_ms": round(iqr, 3), "forecast_ms": round(fc_ms[0], 3),
                         "compute_ms": round(fc_ms[1], 3), "exposed_comm_ms": round(fc_ms[2], 3),
                         "comm_ms": round(fc_ms[3], 3), "link": link,
                         "err_pct": round(100.0 * (fc_ms[0] - t.item()) / t.item(), 2)}
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(out))


def ddp_cases(names, world, iterations):
    procs = []
    env0 = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", WORLD_SIZE=str(world),
                OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT / 'python'}:{ROOT}")
    for r in range(world):
        env = dict(env0, RANK=str(r), LOCAL_RANK=str(r))
        procs.append(subprocess.Popen([sys.executable, __file__, "--ddp-worker", "--ddp-cases", ",".join(names),
                                       "--iterations", str(iterations)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=3600) for p in procs]
    for p, (o, e) in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"DDP worker failed: {e[-2000:]}")
    res = json.loads(outs[0][0].strip().splitlines()[-1])
    rows = [res[n] for n in names]
    for r in rows:
        print(f"DDP x{world} {r['case']:<14} global batch {r['global_batch']:>4}: measured {r['measured_ms']:.2f} ms "
              f"(IQR {r['iqr_ms']:.2f}), forecast {r['forecast_ms']:.2f} ms (compute {r['compute_ms']:.2f}, exposed "
              f"comm {r['exposed_comm_ms']:.2f} of {r['comm_ms']:.2f}), error {r['err_pct']:+.2f} %")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--iterations", type=int, default=15)
    ap.add_argument("--ddp", default="2,4", help="comma-separated process counts for the DDP part ('' to skip)")
    ap.add_argument("--ddp-cases", default="mlp,cnn,gpt")
    ap.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ddp_worker:
        return ddp_worker(args)
    rows = cpu_cases(args.cases.split(","), args.iterations)
    mre = statistics.mean(abs(r["err_pct"]) for r in rows)
    print(f"CPU, one process: mean |error| {mre:.2f} % over {len(rows)} cases")
    ddp = {}
    for w in [int(x) for x in args.ddp.split(",") if x]:
        ddp[w] = ddp_cases(args.ddp_cases.split(","), w, args.iterations)
        print(f"DDP x{w}: mean |error| {statistics.mean(abs(r['err_pct']) for r in ddp[w]):.2f} %")
    ddp2 = ddp.get(2)
    ns = subprocess.run([sys.executable, str(ROOT / "bench" / "neusight_parallel.py")], capture_output=True, text=True,
                        env=dict(os.environ, PYTHONPATH=f"{ROOT / 'python'}:{ROOT}"))
    print("\n".join(ns.stdout.strip().splitlines()[:-1]))
    neusight = json.loads(ns.stdout.strip().splitlines()[-1]) if ns.returncode == 0 else {"neusight_mre_pct": None}
    print(json.dumps({"bench": "step_time_accuracy", "cpu_mre_pct": round(mre, 3), "cpu_ood_mre_pct": None,
                      "ddp_mre_pct": None if not ddp2 else round(statistics.mean(abs(r["err_pct"]) for r in ddp2), 3),
                      "neusight_mre_pct": neusight["neusight_mre_pct"], "cases": rows,
                      "ddp": {str(w): r for w, r in ddp.items()}, "neusight": neusight.get("cases", [])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
