"""On a GPU: the step-time checks (bench/gpu/run.sh runs it; it runs on the CPU too with --device cpu, as a rehearsal).

Per case (the zoo's GPT-style decoder and CNN, torchvision's ResNet-18), at one batch size, in one process:
  measured        median of 20 untraced steps (synchronised), with the interquartile range
  trace           one steady iteration traced by gpucast: the device-timing source ("cupti", else "cuda_events"),
                  the share of recorded ops that carry a device time, and the per-layer device times summed
                  (layers + optimizer) against the measured step: the target is within 5 %; and every op's device
                  time in the iteration (layers, optimizer and the ops outside both: the loss, zero_grad)
  sparse          the same iteration traced with a quarter of the layers timed (chosen by gpucast's D-optimal
                  design: timed_layers): ops with a device time, the timed layers' device times against the same
                  layers' in the full trace (from a one-step window, and from the second iteration of a two-step
                  one: whether a window's first kernels carry a cost of their own), and the traced step's wall
                  time over the untraced one for both traces; the full trace's kernel time per iteration of its
                  two-step window (window_iterations_kernel_ms) asks the same of every op
  on device       gpucast.forecast(target=<this GPU>) with probes on the GPU (measured kernel times): fc.time.step_ms
                  against measured; w/o half: the same probes' forecast without the timing probe at half the
                  target that forecast() adds beyond 3 times the largest probe; again with time_fraction=0.25
                  (sparse timing)
  CPU probes      gpucast.forecast(target=<this GPU>) with the same model and probes on the CPU (priced from the
                  GPU rates table): fc.time.step_ms against measured
  torch.profiler  after every case, in a pass of its own (its CUPTI client never meets gpucast's): the device time
                  of one step measured by torch.profiler (the median over 3 profiled steps of the summed durations
                  of its kernel, memcpy and memset events), an independent reference for the kernel time gpucast
                  attributes: where the host's launches bound the step, the kernels take a fraction of the wall,
                  and the layer sums are compared with the device's busy time instead
Last line: one JSON object.

    python bench/gpu/step_time_check.py --target H100-80GB [--device cuda] [--cases gpt,cnn,resnet18,gpt@1024]

A case is a zoo or real-architecture name, at its default batch size or at name@batch: the default ones are small
enough that an H200 step is bound by the host's launches (the kernels take a fraction of it); a large batch makes
the device the bound, where the per-layer kernel times should add up to the step.
    python bench/gpu/step_time_check.py --target cpu --device cpu --stand-in   (a rehearsal without a GPU)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]

BATCH = {"gpt": 64, "cnn": 128, "resnet18": 64}
PROBES = {"cuda": (4, 8, 16), "cpu": (2, 4)}


def build(name: str, device: str):
    import torch
    from examples import zoo
    cases = dict(zoo.CASES)
    if name not in cases:
        cases.update(zoo.real_cases())
    case = cases[name]
    torch.manual_seed(0)
    model = case.make_model().to(device)
    opt = zoo.make_optimizer("adamw", model.parameters())
    step = zoo.make_step(model, opt, case.loss_fn)

    def make_batch(n: int):
        return tuple(t.to(device) for t in case.make_batch(n))
    return model, opt, step, make_batch


def measure(step, batch, device: str, n: int = 20) -> tuple[float, float]:
    import torch
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        step(batch)
    times = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        step(batch)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(times, n=4)
    return statistics.median(times), q[2] - q[0]


def window_iterations_kernels_ms(doc: dict) -> list[float | None]:
    """Every op's device time in each complete iteration of a trace window, in order (the ops outside any other op:
    layers, the optimizer, the loss and the rest; iterations end at the optimizer steps, a window without one is
    one iteration), None for an iteration without device times. The first iteration of a CUPTI window against the
    next shows whether the window's first kernels carry a cost of their own (a one-step timing trace would then
    charge it to its first layers)."""
    ops = doc.get("ops", [])
    ends = sorted(o["end_seq"] for o in ops if o.get("depth") == 0 and o.get("name", "").startswith("Optimizer.step#"))
    out, lo = [], -1
    for hi in ends or [None]:
        ns = [o["device_ns"] for o in ops if o.get("parent", -1) < 0 and o.get("device_ns", -1) >= 0 and
              o["start_seq"] > lo and (hi is None or o["end_seq"] <= hi)]
        out.append(sum(ns) / 1e6 if ns else None)
        lo = hi
    return out


def iteration_kernels_ms(doc: dict) -> float | None:
    """Every op's device time in the last complete iteration of a trace, the iteration as gpucast's iteration
    timing takes it: from the end of the last optimizer step but one to the end of the last. None without device
    times."""
    return window_iterations_kernels_ms(doc)[-1]


def profiler_kernels_ms(step, batch, runs: int = 3) -> tuple[float | None, int, str]:
    """The device's busy time in one step by torch.profiler (CUDA activity): the summed durations of the kernel,
    memcpy and memset events of a profiled step, the median over `runs` steps; with the event count of that step
    and an error text where the profiler could not run (None, 0, text)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    got = []
    try:
        for _ in range(runs):
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step(batch)
                torch.cuda.synchronize()
            ev = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
            got.append((sum(e.time_range.elapsed_us() for e in ev) / 1e3, len(ev)))
    except Exception as e:  # noqa: BLE001  (the reference is optional: the row says why it is missing)
        return None, 0, f"{type(e).__name__}: {e}"
    got.sort()
    ms, n = got[len(got) // 2]
    return ms, n, ""


def profiler_pass(rows: list, args) -> None:
    """torch.profiler's device time of one step per case (cuda only), in rows[i]["profiler"], after every gpucast
    trace of the run: two CUPTI clients never share the process's activity API at once."""
    for r in rows:
        name, _, at = r["case"].partition("@")
        model, opt, step, make_batch = build(name, args.device)
        batch = make_batch(r["batch"])
        for _ in range(3):
            step(batch)
        ms, n, err = profiler_kernels_ms(step, batch)
        ref = {"kernels_ms": None if ms is None else round(ms, 3), "events": n}
        if err:
            ref["error"] = err
        if ms:
            ref["layer_sum_err_pct"] = pct(r["layer_sum_ms"], ms)
            if r.get("all_ops_kernel_ms") is not None:
                ref["all_ops_err_pct"] = pct(r["all_ops_kernel_ms"], ms)
            ref["kernels_over_measured"] = round(ms / r["measured_ms"], 4)
        r["profiler"] = ref
        print(json.dumps({"case": r["case"], "profiler": ref}), flush=True)
        del model, opt, step, batch


def pct(x: float | None, ref: float) -> float | None:
    return None if x is None else round(100 * (x / ref - 1), 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="the GPU's name in gpucast's device table, or cpu")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--cases", default="gpt,cnn,resnet18")
    ap.add_argument("--save-timings", metavar="DIR",
                    help="save each forecast's probe timings (fc.timings) as DIR/<case>_<variant>.json, to replay "
                         "the step-time forecast elsewhere, and the traced iteration with the measured step as "
                         "DIR/<case>_trace.json.gz")
    ap.add_argument("--stand-in", action="store_true",
                    help="rehearsal on the CPU: device timing through gpucast's CPU-clock stand-in for CUPTI")
    args = ap.parse_args()
    if args.stand_in:
        import torch
        import gpucast  # noqa: F401  (loads the library)
        torch.ops.gpucast._use_stand_in_device_timer(True)
    rows = []
    for name in args.cases.split(","):
        try:
            rows.append(check(name, args))
        except Exception as e:  # one case failing (a package missing on the GPU machine) leaves the others
            print(f"{name}: {type(e).__name__}: {e}", flush=True)
            continue
        print(json.dumps(rows[-1]), flush=True)
    if args.device == "cuda":
        profiler_pass(rows, args)
    report(rows, args)
    return 0


def check(spec: str, args) -> dict:
    import torch
    import gpucast
    name, _, at = spec.partition("@")
    b = int(at) if at else BATCH[name]
    model, opt, step, make_batch = build(name, args.device)
    batch = make_batch(b)
    measured, iqr = measure(step, batch, args.device)
    with gpucast.trace() as t:
        step(batch)
        step(batch)
    it = json.loads(t.result.handle.iteration_timing(b))
    doc = json.loads(t.result.handle.to_json())
    ops = doc.get("ops", [])
    timed = sum(1 for o in ops if o.get("device_ns", -1) >= 0)
    source = doc.get("timing_source")
    trace_notes = doc.get("notes", [])
    layers_ms = (sum(l["forward_ns"] + l["backward_ns"] for l in it["layers"]) + it["optimizer_ns"]) / 1e6
    all_ops_ms = iteration_kernels_ms(doc) if source in ("cupti", "cuda_events") or args.stand_in else None
    per_iteration = ([None if x is None else round(x, 3) for x in window_iterations_kernels_ms(doc)]
                     if all_ops_ms is not None else [])
    save_trace(args, spec, doc, measured)
    del t, doc
    sparse = sparse_check(step, batch, b, it, args.device)
    fc = gpucast.forecast(step, make_batch, b, model=model, optimizer=opt, target=args.target,
                          probe_batch_sizes=PROBES[args.device])
    on_target = fc.time.step_ms if fc.time is not None else None
    # The same forecast without the timing probe at half the target (added when the target is over 3 times the
    # largest probe), to tell what it changes.
    small = [x for x in fc.timings if json.loads(x)["batch"] in PROBES[args.device]]
    no_reach = (dataclasses.replace(fc, timings=small).step_time(b).step_ms
                if fc.time is not None and small and len(small) < len(fc.timings) else None)
    save_timings(args, spec, b, "device", fc)
    fc = gpucast.forecast(step, make_batch, b, model=model, optimizer=opt, target=args.target,
                          probe_batch_sizes=PROBES[args.device], time_fraction=0.25)
    on_target_sparse = fc.time.step_ms if fc.time is not None else None
    save_timings(args, spec, b, "device_sparse", fc)
    del model, opt, step, batch, fc
    if args.device == "cuda":
        torch.cuda.empty_cache()
    from_cpu = None
    if args.device == "cuda":
        model, opt, step, make_cpu = build(name, "cpu")
        fc = gpucast.forecast(step, make_cpu, b, model=model, optimizer=opt, target=args.target,
                              probe_batch_sizes=PROBES["cpu"])
        from_cpu = fc.time.step_ms if fc.time is not None else None
        save_timings(args, spec, b, "cpu", fc)
        del model, opt, step, fc
    return dict(case=spec, batch=b, measured_ms=round(measured, 3), iqr_ms=round(iqr, 3), timing_source=source,
                ops=len(ops), ops_with_device_time=timed, layer_sum_ms=round(layers_ms, 3),
                layer_sum_err_pct=pct(layers_ms, measured),
                all_ops_kernel_ms=None if all_ops_ms is None else round(all_ops_ms, 3),
                window_iterations_kernel_ms=per_iteration, gpu_probe_forecast_ms=on_target and round(on_target, 3),
                gpu_probe_err_pct=pct(on_target, measured),
                gpu_probe_no_reach_forecast_ms=no_reach and round(no_reach, 3),
                gpu_probe_no_reach_err_pct=pct(no_reach, measured),
                gpu_sparse_forecast_ms=on_target_sparse and round(on_target_sparse, 3),
                gpu_sparse_err_pct=pct(on_target_sparse, measured), cpu_probe_forecast_ms=from_cpu and round(from_cpu, 3),
                cpu_probe_err_pct=pct(from_cpu, measured), sparse=sparse, trace_notes=trace_notes)


def save_trace(args, name: str, doc: dict, measured_ms: float) -> None:
    """The traced steady iteration (every op's host clocks and device time) beside the untraced step's median, as
    DIR/<case>_trace.json.gz: what a model of the launch queue (the device waiting on the host's launches) is
    fitted and checked on elsewhere."""
    if not args.save_timings:
        return
    import gzip
    import os
    os.makedirs(args.save_timings, exist_ok=True)
    with gzip.open(os.path.join(args.save_timings, f"{name.replace('@', '_b')}_trace.json.gz"), "wt") as f:
        json.dump({"case": name, "measured_ms": measured_ms, "trace": doc}, f)


def save_timings(args, name: str, batch: int, variant: str, fc) -> None:
    if not args.save_timings:
        return
    import os
    os.makedirs(args.save_timings, exist_ok=True)
    doc = {"case": name, "variant": variant, "target": args.target, "batch": batch,
           "probe_batch_sizes": list(fc.probe_batch_sizes), "step_ms": fc.time.step_ms if fc.time else None,
           "timings": [json.loads(t) for t in fc.timings],
           "time": fc.to_dict().get("time")}
    with open(os.path.join(args.save_timings, f"{name.replace('@', '_b')}_{variant}.json"), "w") as f:
        json.dump(doc, f)


def sparse_check(step, batch, b: int, full: dict, device: str) -> dict:
    """A quarter of the layers timed (timed_layers) against every layer timed, on the same steady step: which ops
    carry a device time, the chosen layers' device times in both traces, and each trace's wall over untraced."""
    import torch
    import gpucast
    chosen = list(torch.ops.gpucast.choose_timed_layers(json.dumps(full), 0.25))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def fastest(traced: bool, **kw) -> tuple[float, object]:
        best, kept = None, None
        for _ in range(5):  # the fastest of five: a pause of the machine only ever adds time
            sync()
            t0 = time.perf_counter()
            if traced:
                with gpucast.trace(record_shapes=False, memory=False, **kw) as t:
                    step(batch)
            else:
                t = None
                step(batch)
            sync()
            ms = (time.perf_counter() - t0) * 1e3
            if best is None or ms < best:
                best, kept = ms, t
        return best, kept

    untraced, _ = fastest(False)
    all_ms, _ = fastest(True)
    sparse_ms, t = fastest(True, timed_layers=chosen)
    doc = json.loads(t.result.handle.to_json())
    ops = doc.get("ops", [])
    it = json.loads(t.result.handle.iteration_timing(b))
    mine = {l["layer"]: l["forward_ns"] + l["backward_ns"] for l in it["layers"] if l["timed"]}
    # The same choice over a two-step window, its second iteration (iteration_timing takes the last): whether the
    # one-step window's chosen layers carry the window's first kernels' cost.
    sync()
    with gpucast.trace(record_shapes=False, memory=False, timed_layers=chosen) as t2:
        step(batch)
        step(batch)
    sync()
    it2 = json.loads(t2.result.handle.iteration_timing(b))
    second = sum(l["forward_ns"] + l["backward_ns"] for l in it2["layers"] if l["timed"])
    theirs = {l["layer"]: l["forward_ns"] + l["backward_ns"] for l in full["layers"] if l["layer"] in mine}
    both = sum(theirs.values())
    return dict(layers=len(full["layers"]), timed_layers=len(chosen), timed_layers_found=len(mine),
                ops=len(ops), ops_with_device_time=sum(1 for o in ops if o.get("device_ns", -1) >= 0),
                chosen_ms=round(sum(mine.values()) / 1e6, 3), chosen_in_full_ms=round(both / 1e6, 3),
                chosen_err_pct=pct(sum(mine.values()), both) if both > 0 else None,
                chosen_second_iteration_ms=round(second / 1e6, 3),
                chosen_second_iteration_err_pct=pct(second, both) if both > 0 else None,
                untraced_ms=round(untraced, 3), all_timed_over_untraced=round(all_ms / untraced, 4),
                sparse_over_untraced=round(sparse_ms / untraced, 4))


def report(rows: list, args) -> None:
    import torch
    print(f"{'case':13} {'batch':>5} {'measured ms':>12} {'layer sum':>10} {'err %':>7} {'all ops':>8} {'timed ops':>10} "
          f"{'on device':>10} {'err %':>7} {'w/o half':>9} {'err %':>7} {'CPU probes':>10} {'err %':>7}")
    for r in rows:
        def f(x, w, p=2):
            return f"{x:{w}.{p}f}" if isinstance(x, (int, float)) else f"{'-':>{w}}"
        print(f"{r['case']:13} {r['batch']:5d} {r['measured_ms']:8.2f}±{r['iqr_ms']:<4.2f} {f(r['layer_sum_ms'], 10)} "
              f"{f(r['layer_sum_err_pct'], 7, 1)} {f(r.get('all_ops_kernel_ms'), 8)} "
              f"{r['ops_with_device_time']:4d}/{r['ops']:<5d} "
              f"{f(r['gpu_probe_forecast_ms'], 10)} {f(r['gpu_probe_err_pct'], 7, 1)} "
              f"{f(r.get('gpu_probe_no_reach_forecast_ms'), 9)} {f(r.get('gpu_probe_no_reach_err_pct'), 7, 1)} "
              f"{f(r['cpu_probe_forecast_ms'], 10)} {f(r['cpu_probe_err_pct'], 7, 1)}")
    print(f"\n{'case':13} {'timed layers':>12} {'ops with device time':>21} {'chosen layers ms':>17} {'in full':>8} "
          f"{'err %':>6} {'2nd it. %':>9} {'traced/untraced: all':>21} {'sparse':>7} {'sparse forecast err %':>22}")
    for r in rows:
        s = r["sparse"]
        e = s["chosen_err_pct"]
        e2 = s.get("chosen_second_iteration_err_pct")
        g = r["gpu_sparse_err_pct"]
        print(f"{r['case']:13} {s['timed_layers']:5d}/{s['layers']:<6d} {s['ops_with_device_time']:10d}/{s['ops']:<10d} "
              f"{s['chosen_ms']:17.3f} {s['chosen_in_full_ms']:8.3f} {'-' if e is None else f'{e:.1f}':>6} "
              f"{'-' if e2 is None else f'{e2:.1f}':>9} "
              f"{s['all_timed_over_untraced']:21.3f} {s['sparse_over_untraced']:7.3f} "
              f"{'-' if g is None else f'{g:.1f}':>22}")
    prof = [r for r in rows if r.get("profiler")]
    if prof:
        print(f"\ndevice time of one step: torch.profiler's kernels (median of 3 profiled steps) against gpucast's")
        print(f"{'case':13} {'measured ms':>11} {'profiler ms':>11} {'of step':>8} {'gpucast all ops':>15} {'err %':>6} "
              f"{'layer sum':>9} {'err %':>6}")
        for r in prof:
            p = r["profiler"]
            if p["kernels_ms"] is None:
                print(f"{r['case']:13} {r['measured_ms']:11.2f}  torch.profiler did not run: {p.get('error', '')}")
                continue
            def g(x, w, d=2):
                return f"{x:{w}.{d}f}" if isinstance(x, (int, float)) else f"{'-':>{w}}"
            print(f"{r['case']:13} {r['measured_ms']:11.2f} {p['kernels_ms']:11.3f} {p['kernels_over_measured']:8.3f} "
                  f"{g(r.get('all_ops_kernel_ms'), 15, 3)} {g(p.get('all_ops_err_pct'), 6, 1)} "
                  f"{r['layer_sum_ms']:9.3f} {g(p.get('layer_sum_err_pct'), 6, 1)}")
    print(json.dumps({"bench": "gpu_step_time_check", "target": args.target, "device": args.device,
                      "torch": torch.__version__, "cases": rows}))


if __name__ == "__main__":
    sys.exit(main())
