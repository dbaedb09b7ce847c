"""Overhead of gpucast's tracer, measured side by side in one run.

For each model (GPT-style example and the CNN, AdamW, one thread):
  gpucast_ratio   traced iteration / untraced iteration; the traced time is the whole
                  `with gpucast.trace()` block: hooks, start, the iteration, stop and assembly
  timing_ratio    the same with the light trace the forecast times its probes with (record_shapes=False,
                  memory=False, nested_ops=False: outermost ops, modules and clocks only)
  profiler_ratio  torch.profiler(record_shapes=True, profile_memory=True) block / untraced
  after_ratio     untraced iteration in a process that has imported gpucast and traced once /
                  untraced iteration in a process that never imported gpucast
The first three are interleaved in one process (untraced, gpucast, timing, profiler, untraced, ...); the third
alternates fresh worker processes of both kinds. Medians with interquartile ranges.

Because after_ratio's target (1.01) is below this machine's timing noise, instructions are also
counted with callgrind over a small iteration (--callgrind, on by default when valgrind is installed):
the same worker kinds, instrumentation switched on only around the measured iterations. Auto mode through
torch.ops.load_library alone (GPUCAST_CONF="enabled:True,target:cpu", no `import gpucast`) is counted the same
way, its first iteration (the traced one, with the forecast made at its end) and later ones against a process that
never loaded gpucast; "lib" loads the library with auto mode off.

Last line: {"bench": "overhead", "results": [{"model", "gpucast_ratio", "profiler_ratio", "after_ratio", ...}]}
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]


def quantiles(xs):
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[1], q[2] - q[0]  # median, IQR


def setup(name, batch=None):
    import torch
    from examples import zoo
    torch.set_num_threads(1)
    torch.manual_seed(0)
    case = zoo.CASES[name]
    model = case.make_model()
    opt = zoo.make_optimizer("adamw", model.parameters())
    step = zoo.make_step(model, opt, case.loss_fn)
    return step, case.make_batch(batch or case.default_batch)


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def in_process(name, iters):
    import torch
    import gpucast
    step, batch = setup(name)
    for _ in range(3):
        step(batch)

    def traced():
        with gpucast.trace():
            step(batch)

    def timing():
        with gpucast.trace(record_shapes=False, memory=False, nested_ops=False):
            step(batch)

    def profiled():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    record_shapes=True, profile_memory=True):
            step(batch)

    times = {"untraced": [], "gpucast": [], "timing": [], "profiler": []}
    for _ in range(iters):
        times["untraced"].append(timed(lambda: step(batch)))
        times["gpucast"].append(timed(traced))
        times["timing"].append(timed(timing))
        times["profiler"].append(timed(profiled))
    return times


def worker(kind, name, iters, batch=None, wait=False, warmup=3):
    """Runs in a fresh process: 'plain' never imports gpucast; 'loaded' imports it; 'after' also traces once;
    'lib' and 'auto' load the library with torch.ops.load_library only (auto: GPUCAST_CONF set by the parent);
    'py_auto' imports gpucast with GPUCAST_CONF set (auto mode with its Python hooks)."""
    if kind in ("lib", "auto"):
        import torch
        torch.ops.load_library(str(ROOT / "build" / "lib" / "libgpucast.so"))
    step, b = setup(name, batch)
    if kind in ("loaded", "after", "py_auto"):
        import gpucast
        if kind == "after":
            with gpucast.trace():
                step(b)
    for _ in range(warmup):
        step(b)
    if wait:  # callgrind: the parent switches instrumentation on, then tells us to go
        print("READY", flush=True)
        sys.stdin.readline()
        for _ in range(iters):
            step(b)
        print("DONE", flush=True)
        sys.stdin.readline()
        return
    print(json.dumps([timed(lambda: step(b)) for _ in range(iters)]), flush=True)


def run_worker(kind, name, iters):
    out = subprocess.run([sys.executable, __file__, "--worker", kind, "--model", name, "--iters", str(iters)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def after_ratio(name, rounds, iters):
    plain, after = [], []
    for _ in range(rounds):
        plain.append(statistics.median(run_worker("plain", name, iters)))
        after.append(statistics.median(run_worker("after", name, iters)))
    (pm, piqr), (am, aiqr) = quantiles(plain), quantiles(after)
    return am / pm, aiqr / pm, piqr / pm


def callgrind_instructions(kind, name, iters, batch, warmup=3):
    """Instructions of `iters` iterations, after `warmup` ones, in a worker of `kind`, counted by callgrind."""
    tmp = tempfile.mkdtemp(prefix="gpucast-callgrind-")
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={tmp}/cg.out.%p",
           sys.executable, __file__, "--worker", kind, "--model", name, "--iters", str(iters),
           "--batch", str(batch), "--wait", "--warmup", str(warmup)]
    env = {k: v for k, v in os.environ.items() if k not in ("GPUCAST_CONF", "GPUCAST_LOG")}
    if kind in ("auto", "py_auto"):
        env["GPUCAST_CONF"] = "enabled:True,target:cpu"
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env=env)
    try:
        assert p.stdout.readline().strip() == "READY"
        subprocess.run(["callgrind_control", "-i", "on", str(p.pid)], check=True, capture_output=True)
        subprocess.run(["callgrind_control", "-z", str(p.pid)], check=True, capture_output=True)
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "DONE"
        subprocess.run(["callgrind_control", "-d", str(p.pid)], check=True, capture_output=True)
        subprocess.run(["callgrind_control", "-i", "off", str(p.pid)], check=True, capture_output=True)
        p.stdin.write("end\n")
        p.stdin.flush()
        p.wait(timeout=600)
        # The dump requested after the iterations (its trigger is "dump"); the one at exit is not ours.
        for f in glob.glob(f"{tmp}/cg.out.*"):
            lines = open(f).read().splitlines()
            if "desc: Trigger: dump" in lines:
                return next(int(line.split()[1]) for line in lines if line.startswith("summary:"))
        raise RuntimeError("callgrind wrote no dump for the measured iterations")
    finally:
        if p.poll() is None:
            p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt,cnn")
    ap.add_argument("--iters", type=int, default=15, help="interleaved iterations per kind (>= 10)")
    ap.add_argument("--rounds", type=int, default=4, help="worker processes of each kind for after_ratio")
    ap.add_argument("--callgrind", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--worker", choices=["plain", "loaded", "after", "lib", "auto", "py_auto"], help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=3, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--wait", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.model, args.iters, args.batch, args.wait, args.warmup)
    if args.iters < 10:
        ap.error(f"--iters must be at least 10, got {args.iters}")

    results = []
    print(f"{'model':<6} {'untraced ms':>12} {'gpucast':>16} {'timing trace':>16} {'torch.profiler':>16} "
          f"{'after tracing':>16}")
    for name in args.models.split(","):
        times = in_process(name, args.iters)
        um, uiqr = quantiles(times["untraced"])
        gm, giqr = quantiles(times["gpucast"])
        tm, tiqr = quantiles(times["timing"])
        pm, piqr = quantiles(times["profiler"])
        ar, aiqr, _ = after_ratio(name, args.rounds, args.iters)
        row = {"model": name, "untraced_ms": round(um * 1e3, 3), "untraced_iqr_ms": round(uiqr * 1e3, 3),
               "gpucast_ratio": round(gm / um, 4), "gpucast_iqr": round(giqr / um, 4),
               "timing_ratio": round(tm / um, 4), "timing_iqr": round(tiqr / um, 4),
               "profiler_ratio": round(pm / um, 4), "profiler_iqr": round(piqr / um, 4),
               "after_ratio": round(ar, 4), "after_iqr": round(aiqr, 4)}
        results.append(row)
        print(f"{name:<6} {um * 1e3:>8.2f} ±{uiqr * 1e3:<5.2f} {gm / um:>8.3f}× ±{giqr / um:<5.3f} "
              f"{tm / um:>8.3f}× ±{tiqr / um:<5.3f} "
              f"{pm / um:>8.3f}× ±{piqr / um:<5.3f} {ar:>8.3f}× ±{aiqr:<5.3f}")

    summary = {"bench": "overhead", "results": results}
    use_cg = args.callgrind == "on" or (args.callgrind == "auto" and shutil.which("valgrind")
                                        and shutil.which("callgrind_control"))
    if use_cg:
        counts = {k: callgrind_instructions(k, "mlp", 5, 8) for k in ("plain", "loaded", "after")}
        cg = {"model": "mlp", "batch": 8, "iterations": 5, "instructions": counts,
              "loaded_ratio": round(counts["loaded"] / counts["plain"], 5),
              "after_ratio": round(counts["after"] / counts["plain"], 5)}
        print(f"callgrind, mlp batch 8, 5 iterations: plain {counts['plain']:,} instr, "
              f"imported {counts['loaded']:,} ({cg['loaded_ratio']:.4f}×), "
              f"after a trace {counts['after']:,} ({cg['after_ratio']:.4f}×)")
        summary["callgrind"] = cg
        summary["auto_load_library"] = auto_rows()
    print(json.dumps(summary))


def auto_rows():
    """Auto mode through torch.ops.load_library: instructions of the first iteration (traced, forecast at its end)
    and of later ones, against a process that never loaded gpucast, all counted in this run; with `import gpucast`
    (py_auto) beside it. The MLP at batch 8 is a small iteration (some 8 million instructions), where the fixed
    costs at the iteration's end (assembling the trace, the forecast) weigh most; the GPT-style model is larger."""
    rows = []
    for model, batch in (("mlp", 8), ("gpt", 8)):
        row = {"model": model, "batch": batch}
        # Later iterations: after 3 (the MLP), or 1 (the GPT-style model, some 20 minutes a kind under callgrind).
        later = (3, 3) if model == "mlp" else (1, 1)
        for label, warmup, iters in (("first_iteration", 0, 1), ("later_iterations", *later)):
            kinds = ("plain", "lib", "auto", "py_auto")
            counts = {k: callgrind_instructions(k, model, iters, batch, warmup=warmup) for k in kinds}
            row[label] = {"iterations": iters, "instructions": counts,
                          **{f"{k}_ratio": round(counts[k] / counts["plain"], 5) for k in kinds[1:]}}
            print(f"auto mode, {model} batch {batch}, {label.replace('_', ' ')} ({iters}): plain {counts['plain']:,} "
                  f"instr; library loaded {row[label]['lib_ratio']:.4f}×; auto mode via torch.ops.load_library "
                  f"{row[label]['auto_ratio']:.4f}×; via import gpucast {row[label]['py_auto_ratio']:.4f}×")
        rows.append(row)
    return rows

if __name__ == "__main__":
    sys.exit(main())
