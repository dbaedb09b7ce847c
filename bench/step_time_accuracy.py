"""Step-time forecast accuracy on this machine.

CPU, one process: for the zoo and real architectures (torchvision, timm, transformers; random weights, AdamW, one
thread), gpucast.forecast(target="cpu", time_fraction=0.25) forecasts the step time at a target batch from traced
probes at batch 2, 4 and 8 with a quarter of the layers timed (D-optimal design; the rest from per-kind roofline
models) and the shipped graph network's correction; the real step is measured in the same process, the median
of --iterations with its interquartile range: half of them before the forecast (on the same model built again),
half after it, each half after 3 warm-up iterations. The machine is shared and its speed drifts over minutes:
bracketing the forecast centres the reference on the probes' time, and each case is forecast and measured
--repeats times (the model built again each time) and the repeat with the median error is reported, every
repeat's error beside it. Beside it, from the same probes: the
forecast without the graph network (alpha = beta = 1: the ablation), with every layer timed, and from the first
of the probes' timing rounds alone (what forecast(timing_rounds=1) gives; the forecast takes the median of three),
and the forecast's own time in seconds. These cases'
families are in the network's training data (in-domain); out-of-domain numbers (families held out of the
network's training) come from bench/scaledl_compare.py, run here as well unless --skip-scaledl.

Overhead: the probes' traced iteration over the same step untraced (the forecast times both), median over the
cases' probes.

Distributed (--ddp N): torchrun-style N processes on this machine, DDP over gloo on loopback, one thread each. Rank
0 forecasts the DDP step from a single-process trace of the model plus gpucast.calibrate() on the live group; every
rank measures the real DDP step (median of --ddp-iterations, half before the calibration on the same model built
again and wrapped the same way, half after the forecast), the slowest rank's counting; the error against the mean
of the steps is printed beside it, and every rank's step times are in the JSON (steps_ms). Beside it, as many steps
of the plain module (no DDP) on every rank at once, half before the calibration and half after the DDP steps: the
forecast's compute against them, and what DDP adds to them against the forecast's communication and lag. Ablations
from the same probes: without the all-reduce samples after a long idle spell, without the drift rates (the
constant lag instead), without either. And how much CPU time the hypervisor gave other guests during the case
(/proc/stat steal): collectives need every rank's vCPU running at once, and stolen time delays them most. The
whole DDP run is repeated --ddp-repeats times in fresh processes (the machine is shared: calibration, probes and
the measured step each vary from run to run); per case, the repeat with the median error is reported, with every
repeat's error.

NeuSight's 4-GPU measurements: bench/neusight_parallel.py (dp4, tp4, pp4); vTrain's data-parallel scaling:
bench/vtrain_scaling.py; both run here. Signed error = (forecast - measured) / measured. Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import dataclasses
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


def case_of(name):
    """The zoo's or the real architectures' case `name` (nothing built)."""
    from examples import zoo
    cases = dict(zoo.CASES)
    cases.update(zoo.real_cases())
    return cases[name]


def build(name):
    import torch
    from examples import zoo
    torch.manual_seed(0)
    case = case_of(name)
    model = case.make_model()
    opt = zoo.make_optimizer("adamw", model.parameters())
    return case, model, opt, zoo.make_step(model, opt, case.loss_fn)


def timed(step, batch, iterations):
    """Milliseconds of `iterations` steps after 3 warm-up steps."""
    for _ in range(3):
        step(batch)
    ts = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        step(batch)
        ts.append((time.perf_counter() - t0) * 1e3)
    return ts


def summary(ts):
    """Median and interquartile range."""
    q = statistics.quantiles(sorted(ts), n=4)
    return statistics.median(ts), q[2] - q[0]


def cpu_cases(names, iterations, fraction, repeats=1, other_gnn=""):
    import torch
    torch.set_num_threads(1)
    rows = []
    print(f"{'case':<20} {'batch':>5} {'measured ms':>12} {'IQR':>6} {'gpucast ms':>11} {'err %':>7} "
          f"{'α=β=1 %':>8} {'all timed %':>11} {'1 round %':>9} {'alpha':>6} {'timed':>7} {'traced/untraced':>15} "
          f"{'fc s':>5}  repeats' err %")
    for name in names:
        # Each repeat builds the model again, forecasts and measures; the repeat with the median error is kept.
        tries = sorted((cpu_case(name, iterations, fraction, other_gnn) for _ in range(repeats)),
                       key=lambda r: r["err_pct"])
        row = dict(tries[len(tries) // 2])
        row["repeat_err_pct"] = [t["err_pct"] for t in tries]
        row["repeat_no_gnn_err_pct"] = [t["no_gnn_err_pct"] for t in tries]
        if other_gnn:
            row["repeat_other_gnn_err_pct"] = [t["other_gnn_err_pct"] for t in tries]
        row["traced_over_untraced"] = [x for t in tries for x in t["traced_over_untraced"]]
        rows.append(row)
        ratios = row["traced_over_untraced"]
        print(f"{name:<20} {row['batch']:>5} {row['measured_ms']:>12.2f} {row['iqr_ms']:>6.2f} "
              f"{row['forecast_ms']:>11.2f} {row['err_pct']:>+7.2f} {row['no_gnn_err_pct']:>+8.2f} "
              f"{row['all_timed_err_pct']:>+11.2f} {row['one_round_err_pct']:>+9.2f} {row['alpha']:>6.3f} "
              f"{row['timed_layers']:>3}/{row['layers']:<3} "
              f"{statistics.median(ratios) if ratios else float('nan'):>15.3f} {row['forecast_s']:>5.1f}  "
              f"{', '.join(f'{e:+.2f}' for e in row['repeat_err_pct'])}", flush=True)
    return rows


def bracketed(build, make_batch, batch, iterations, forecast):
    """The CPU cases' measurement around a forecast (this bench's, the dataset recorder's and timing_rounds.py's).
    build() returns a fresh (model, optimizer, step); forecast(model, optimizer, step) runs the forecast. Returns
    (its result, the model, the measured median ms, its interquartile range, the forecast's seconds)."""
    import torch
    # The C allocator as forecast() leaves it (and as a training run soon has it): the steps measured before the
    # forecast run in the same state as those after it (bench/results/findings.md: where the CPU runs' spread comes from).
    torch.ops.gpucast.settle_c_allocator()
    # The measured iterations bracket the forecast (half before it, on the same model built again, half after):
    # the machine's speed drifts over minutes, and the reference is then centred on the probes' time.
    twin_step = build()[2]
    before = timed(twin_step, make_batch(batch), iterations // 2)
    del twin_step  # the twin's model and optimizer with it
    model, opt, step = build()
    t0 = time.perf_counter()
    fc = forecast(model, opt, step)
    seconds = time.perf_counter() - t0
    measured, iqr = summary(before + timed(step, make_batch(batch), iterations - iterations // 2))
    return fc, model, measured, iqr, seconds


def cpu_case(name, iterations, fraction, other_gnn=""):
    import gpucast
    batch = CASES[name]
    case = case_of(name)
    fc, _, measured, iqr, forecast_s = bracketed(
        lambda: build(name)[1:], case.make_batch, batch, iterations,
        lambda model, opt, step: gpucast.forecast(step, case.make_batch, batch, model=model, optimizer=opt,
                                                  target="cpu", time_fraction=fraction))
    t = fc.time
    plain = fc.step_time(batch, gnn=None).step_ms  # the same timed layers, without the graph network
    every = fc.step_time(batch, time_fraction=1.0, gnn=None).step_ms
    rounds = fc.timing_rounds or [fc.timings]
    one = dataclasses.replace(fc, timings=rounds[0]).step_time(batch).step_ms  # the first timing round alone
    ratios = [p["wall_ns"] / p["untraced_wall_ns"] for r in rounds for p in map(json.loads, r)
              if p.get("untraced_wall_ns", -1) > 0]
    err = 100.0 * (t.step_ms - measured) / measured
    row = {"case": name, "batch": batch, "measured_ms": round(measured, 3), "iqr_ms": round(iqr, 3),
           "forecast_ms": round(t.step_ms, 3), "err_pct": round(err, 2), "alpha": round(t.alpha, 4),
           "correction": t.correction, "no_gnn_ms": round(plain, 3),
           "no_gnn_err_pct": round(100.0 * (plain - measured) / measured, 2), "all_timed_ms": round(every, 3),
           "all_timed_err_pct": round(100.0 * (every - measured) / measured, 2), "layers": len(t.per_layer),
           "timed_layers": t.timed_layers, "traced_over_untraced": [round(x, 4) for x in ratios],
           "one_round_ms": round(one, 3), "one_round_err_pct": round(100.0 * (one - measured) / measured, 2),
           "timing_rounds": len(rounds), "forecast_s": round(forecast_s, 2)}
    if other_gnn:  # another network's correction of the same forecast (--other-gnn)
        o = fc.step_time(batch, gnn=other_gnn)
        row.update(other_gnn_ms=round(o.step_ms, 3), other_gnn_err_pct=round(100.0 * (o.step_ms - measured) / measured, 2),
                   other_gnn_correction=o.correction)
    return row


def steal_jiffies():
    """(stolen, total) CPU time of this host so far, from /proc/stat (a virtual machine's vCPUs lose 'steal'
    time to other guests); None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:]]
        return cpu[7], sum(cpu[:8])
    except (OSError, ValueError, IndexError):
        return None


def ddp_worker(args):
    """One rank of the DDP run (started by ddp_cases with RANK / WORLD_SIZE / MASTER_* set)."""
    import datetime
    import torch
    import torch.distributed as dist
    import gpucast
    torch.set_num_threads(1)
    torch.ops.gpucast.settle_c_allocator()  # as forecast() leaves it: the steps before and after alike
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in args.ddp_cases.split(","):
        batch = CASES[name] * world  # global batch: the single-process batch per rank
        from examples import zoo
        steal0 = steal_jiffies()
        # Half the measured iterations before the calibration and the forecast (the same model built again),
        # half after: the reference is centred on the time of the calibration and the probes.
        twin_case, twin, twin_opt, _ = build(name)
        twin_ddp = torch.nn.parallel.DistributedDataParallel(twin)
        before = timed(zoo.make_step(twin_ddp, twin_opt, twin_case.loss_fn), twin_case.make_batch(batch // world),
                       args.ddp_iterations // 2)
        del twin_case, twin, twin_opt, twin_ddp
        # The plain module's step on every rank at once (no DDP): what the forecast's compute stands for, measured
        # beside the DDP step (half before the calibration, half after the DDP steps), so that the error splits
        # into compute and communication.
        plain_case, _, _, plain_step = build(name)
        dist.barrier()
        plain = timed(plain_step, plain_case.make_batch(batch // world), args.ddp_iterations // 2)
        case, model, opt, step = build(name)
        link = gpucast.calibrate()
        fc_ms = None
        if rank == 0:
            fc = gpucast.forecast(step, case.make_batch, batch, model=model, optimizer=opt, target="cpu",
                                  parallel=dict(dp=world), link=link, time_fraction=args.fraction)
            # Ablations from the same probes: without the all-reduces after a long idle spell, without the drift
            # rates (the constant lag instead), without either.
            def without(*keys):
                return fc.step_time(batch, parallel=dict(dp=world),
                                    link={k: v for k, v in link.items() if k not in keys}).step_ms
            late, drift = ("late_samples", "late_gap_us"), ("drift_compute", "drift_memory")
            fc_ms = (fc.time.step_ms, fc.time.compute_ms, fc.time.exposed_comm_ms, fc.time.comm_ms,
                     {"no_late": without(*late), "no_drift": without(*drift), "neither": without(*late, *drift)})
        dist.barrier()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        dstep = zoo.make_step(ddp, opt, case.loss_fn)
        after = args.ddp_iterations - args.ddp_iterations // 2
        steps = before + timed(dstep, case.make_batch(batch // world), after)
        dist.barrier()
        plain += timed(plain_step, plain_case.make_batch(batch // world), after)
        del plain_case, plain_step
        steal1 = steal_jiffies()
        stolen = (100.0 * (steal1[0] - steal0[0]) / max(1, steal1[1] - steal0[1])) if steal0 and steal1 else None
        measured, iqr = summary(steps)
        t = torch.tensor([measured, statistics.mean(steps), statistics.median(plain)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank ends
        every = [torch.zeros(len(steps), dtype=torch.float64) for _ in range(world)]
        dist.all_gather(every, torch.tensor(steps, dtype=torch.float64))
        if rank == 0:
            med, mean, plain_med = t.tolist()
            out[name] = {"case": name, "world": world, "global_batch": batch, "measured_ms": round(med, 3),
                         "iqr_ms": round(iqr, 3), "measured_mean_ms": round(mean, 3), "forecast_ms": round(fc_ms[0], 3),
                         "compute_ms": round(fc_ms[1], 3), "exposed_comm_ms": round(fc_ms[2], 3),
                         "comm_ms": round(fc_ms[3], 3), "link": link,
                         "plain_ms": round(plain_med, 3), "ddp_extra_ms": round(med - plain_med, 3),
                         "compute_err_pct": round(100.0 * (fc_ms[1] - plain_med) / plain_med, 2),
                         "ablation_err_pct": {k: round(100.0 * (v - med) / med, 2) for k, v in fc_ms[4].items()},
                         "steal_pct": None if stolen is None else round(stolen, 2),
                         "err_pct": round(100.0 * (fc_ms[0] - med) / med, 2),
                         "mean_err_pct": round(100.0 * (fc_ms[0] - mean) / mean, 2),
                         "steps_ms": [[round(x, 3) for x in e.tolist()] for e in every]}
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(out))


def ddp_cases(names, world, iterations, fraction, repeats=1):
    """Each case `repeats` times, every time in fresh processes (calibration, forecast and measurement again); the
    row kept for a case is the repeat with the median error, with every repeat's error beside it."""
    rows = median_repeats([ddp_run(names, world, iterations, fraction) for _ in range(repeats)])
    for r in rows:
        print(f"DDP x{world} {r['case']:<14} global batch {r['global_batch']:>4}: measured {r['measured_ms']:.2f} ms "
              f"(IQR {r['iqr_ms']:.2f}), forecast {r['forecast_ms']:.2f} ms (compute {r['compute_ms']:.2f}, exposed "
              f"comm {r['exposed_comm_ms']:.2f} of {r['comm_ms']:.2f}; calibrated lag of the last rank "
              f"{r['link'].get('sync_wait_us', 0) / 1e3:.2f} ms), error {r['err_pct']:+.2f} % (median of "
              f"{len(r['repeat_err_pct'])} runs: {', '.join(f'{e:+.2f}' for e in r['repeat_err_pct'])}); against "
              f"the mean of the measured steps ({r['measured_mean_ms']:.2f} ms) {r['mean_err_pct']:+.2f} %; host "
              f"contention compute x{r['link'].get('compute_contention', 1):.2f}, memory "
              f"x{r['link'].get('memory_contention', 1):.2f}; the plain module's step on every rank at once "
              f"{r['plain_ms']:.2f} ms (forecast compute {r['compute_err_pct']:+.2f} % from it; DDP adds "
              f"{r['ddp_extra_ms']:.2f} ms, the forecast {r['forecast_ms'] - r['compute_ms']:.2f}); error without "
              f"the late all-reduce samples {r['ablation_err_pct']['no_late']:+.2f} %, without the drift rates "
              f"{r['ablation_err_pct']['no_drift']:+.2f} %, without either {r['ablation_err_pct']['neither']:+.2f} %; "
              f"CPU time stolen by the hypervisor during the case "
              f"{'n/a' if r['steal_pct'] is None else format(r['steal_pct'], '.1f') + ' %'}")
    return rows


def median_repeats(runs):
    """Per case (runs: one list of rows per repeat, the cases in the same order), the repeat with the median error,
    with every repeat's error beside it (repeat_err_pct)."""
    rows = []
    for i in range(len(runs[0])):
        tries = sorted((run[i] for run in runs), key=lambda r: r["err_pct"])
        row = dict(tries[len(tries) // 2])
        row["repeat_err_pct"] = [run[i]["err_pct"] for run in runs]
        rows.append(row)
    return rows


def launch_ranks(script, argv, world, port, what, env=None):
    """`world` processes of `script argv` on this machine (RANK, WORLD_SIZE, MASTER_* set; one thread each), waited
    for; rank 0's last stdout line as JSON. A rank that fails stops the bench with its stderr's tail."""
    env0 = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT / 'python'}:{ROOT}", **(env or {}))
    procs = [subprocess.Popen([sys.executable, str(script), *argv], env=dict(env0, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    outs = [p.communicate(timeout=3600) for p in procs]
    for r, (p, (_, e)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            raise SystemExit(f"{what} worker {r} failed: {e[-3000:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def ddp_run(names, world, iterations, fraction):
    res = launch_ranks(__file__, ["--ddp-worker", "--ddp-cases", ",".join(names), "--ddp-iterations", str(iterations),
                                  "--fraction", str(fraction)], world, 29533, "DDP")
    return [res[n] for n in names]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--other-gnn", default="", metavar="FILE",
                    help="also correct every CPU forecast with this graph network's weights (a candidate against the "
                         "shipped one on the same probes): its error per case and its mean")
    ap.add_argument("--iterations", type=int, default=15, help="measured steps per CPU case")
    ap.add_argument("--ddp-iterations", type=int, default=30,
                    help="measured DDP steps per case (and as many of the plain module's)")
    ap.add_argument("--ddp", default="2,4", help="comma-separated process counts for the DDP part ('' to skip)")
    ap.add_argument("--ddp-cases", default="mlp,cnn,gpt")
    ap.add_argument("--repeats", type=int, default=3, help="forecast and measurement per CPU case (median error kept)")
    ap.add_argument("--ddp-repeats", type=int, default=3, help="fresh DDP runs per process count (median error kept)")
    ap.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fraction", type=float, default=0.25, help="fraction of layers timed (default 0.25)")
    ap.add_argument("--skip-scaledl", action="store_true", help="do not run bench/scaledl_compare.py")
    args = ap.parse_args()
    if args.ddp_worker:
        return ddp_worker(args)
    # The C allocator's settings move the CPU steps (bench/results/findings.md: where the CPU runs' spread comes from): say them.
    malloc_env = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    if malloc_env:
        print("malloc settings: " + ", ".join(f"{k}={v}" for k, v in sorted(malloc_env.items())))
    rows = cpu_cases(args.cases.split(","), args.iterations, args.fraction, args.repeats, args.other_gnn)
    mre = statistics.mean(abs(r["err_pct"]) for r in rows)
    mre_plain = statistics.mean(abs(r["no_gnn_err_pct"]) for r in rows)
    mre_all = statistics.mean(abs(r["all_timed_err_pct"]) for r in rows)
    mre_one = statistics.mean(abs(r["one_round_err_pct"]) for r in rows)
    ratios = [x for r in rows for x in r["traced_over_untraced"]]
    overhead = statistics.median(ratios) if ratios else None
    print(f"CPU, one process, {args.fraction:.0%} of layers timed: mean |error| {mre:.2f} % with the graph network, "
          f"{mre_plain:.2f} % without (alpha = beta = 1), {mre_all:.2f} % every layer timed without it, "
          f"{mre_one:.2f} % from the first of {rows[0]['timing_rounds']} timing rounds alone; "
          f"{len(rows)} cases (in-domain families)")
    if args.other_gnn:
        mre_other = statistics.mean(abs(r["other_gnn_err_pct"]) for r in rows)
        print(f"the same forecasts corrected by {args.other_gnn} instead: mean |error| {mre_other:.2f} % ("
              + ", ".join(f"{r['case']} {r['other_gnn_err_pct']:+.2f}" for r in rows) + ")")
        every = {k: statistics.mean(abs(e) for r in rows for e in r[k])
                 for k in ("repeat_err_pct", "repeat_no_gnn_err_pct", "repeat_other_gnn_err_pct")}
        print(f"over every repeat ({sum(len(r['repeat_err_pct']) for r in rows)} forecasts): mean |error| "
              f"{every['repeat_err_pct']:.2f} % with the shipped network, {every['repeat_other_gnn_err_pct']:.2f} % "
              f"with {args.other_gnn}, {every['repeat_no_gnn_err_pct']:.2f} % without a network")
    print(f"overhead: traced probe iteration / untraced, median over {len(ratios)} probe timings (every round): "
          f"{overhead:.3f}x")
    ddp = {}
    for w in [int(x) for x in args.ddp.split(",") if x]:
        ddp[w] = ddp_cases(args.ddp_cases.split(","), w, args.ddp_iterations, args.fraction, args.ddp_repeats)
        print(f"DDP x{w}: mean |error| {statistics.mean(abs(r['err_pct']) for r in ddp[w]):.2f} %")
    ddp2 = ddp.get(2)
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'python'}:{ROOT}")

    def run(script, *extra):
        p = subprocess.run([sys.executable, str(ROOT / "bench" / script), *extra], capture_output=True, text=True,
                           env=env)
        lines = p.stdout.strip().splitlines()
        print("\n".join(lines[:-1]))
        return json.loads(lines[-1]) if p.returncode == 0 and lines else {}
    neusight = run("neusight_parallel.py")
    vtrain = run("vtrain_scaling.py")
    scaledl = {} if args.skip_scaledl else run("scaledl_compare.py")
    ood = scaledl.get("table", {}).get("gpucast + GNN | out-of-domain", {}).get("mre_pct")
    print(json.dumps({"bench": "step_time_accuracy", "cpu_mre_pct": round(mre, 3), "cpu_ood_mre_pct": ood,
                      "ddp_mre_pct": None if not ddp2 else round(statistics.mean(abs(r["err_pct"]) for r in ddp2), 3),
                      "neusight_mre_pct": neusight.get("neusight_mre_pct"), "cases": rows,
                      "cpu_no_gnn_mre_pct": round(mre_plain, 3), "cpu_all_timed_mre_pct": round(mre_all, 3),
                      "cpu_one_round_mre_pct": round(mre_one, 3),
                      "overhead_ratio": None if overhead is None else round(overhead, 4),
                      "vtrain_mre_pct": vtrain.get("mre_pct"), "ddp": {str(w): r for w, r in ddp.items()},
                      "neusight": neusight.get("cases", []), "scaledl": scaledl}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
