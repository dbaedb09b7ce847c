"""python -m gpucast: the command line.

  python -m gpucast run [--target T] [--log FILE] -- train.py args...   run a script with auto mode on
  python -m gpucast report trace.json [--html out.html] [--png out.png] [--snapshot out.pickle]
                           [--forecast SIZE] [--capacity SIZE_OR_DEVICE]
  python -m gpucast devices                                             the device and GPU rates tables
  python -m gpucast predict-job job.json                                the job-level memory estimate
  python -m gpucast predict-job --hf-config config.json --batch 8 --seq-len 2048   ... from a transformers config
  python -m gpucast plan config.json --gpus N --seq L [--batch B] [--tp 1,2] [--dp-modes fsdp,ddp]
                         [--checkpointing none,full] [--gpu H100-80GB] [--json]   layouts of a model over N GPUs
"""
from __future__ import annotations

import argparse
import os
import re
import runpy
import sys

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
SIZES = ("give bytes (1234567), or a number with a unit: KiB, MiB, GiB, TiB (powers of 1024) or kB, MB, GB, TB "
         "(powers of 1000)")


# Packages only some subcommands need (ImportError with their name: "... needs matplotlib: pip install matplotlib").
OPTIONAL_PACKAGES = ("matplotlib",)


def parse_size(text: str, devices: bool = False) -> int:
    """Bytes from "1234567", "1234MiB", "2GiB", "1.5 GiB", "80GB"; with devices, also a device table name (its
    capacity). ValueError saying what is accepted."""
    if devices:
        import torch

        import gpucast
        try:  # a device table name, as every target is named (the plugin's rule: case-insensitive)
            name = torch.ops.gpucast.check_target(text.strip(), 0)
        except ValueError:
            name = ""
        for d in gpucast.devices():
            if d["name"] == name:
                return int(d["capacity_bytes"])
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    unit = m and _UNITS.get(m.group(2).lower())
    value = float(m.group(1)) * unit if unit else 0
    if not unit or (not m.group(2) and "." in m.group(1)) or value <= 0:
        also = " or a device table name (python -m gpucast devices)" if devices else ""
        raise ValueError(f"'{text}' is not a size: {SIZES}{also}")
    return int(value)


def _size(devices: bool):
    def parse(text: str) -> int:
        try:
            return parse_size(text, devices)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _devices(args) -> int:
    import gpucast
    rows = gpucast.devices()
    print(f"{'name':<12} {'capacity':>12} {'cc':>5} {'context':>9}  {'default link (parallel forecasts)':<44} source")
    for d in rows:
        print(f"{d['name']:<12} {d['capacity_bytes'] / 2**20:>8,.0f} MiB {d['compute_capability']:>5.1f} "
              f"{d['context_bytes'] / 2**20:>5.0f} MiB  {d['default_link']:<44} {d['source']}")
    print()
    print("step time from CPU probes (gpu_rates table):")
    print(f"{'name':<12} {'fp32':>7} {'tf32':>7} {'16-bit':>7} {'memory':>10}  efficiencies fitted on")
    for g in gpucast.gpu_rates():
        print(f"{g['name']:<12} {g['fp32_tflops']:>4.1f} TF {g['tf32_tflops']:>4.0f} TF {g['half_tflops']:>4.0f} TF "
              f"{g['bandwidth_gbps']:>5.0f} GB/s  {g['fitted_on']}")
    return 0


def _report(args) -> int:
    import gpucast
    from ._pictures import require_matplotlib
    for option, path in (("--png", args.png), ("--html", args.html)):
        if path:
            require_matplotlib(f"gpucast report {option}")  # before any output: one line, exit code 2
    t = gpucast.load_trace(args.trace)
    print(t.summary(), end="")
    lines = {"forecast_peak": args.forecast, "capacity": args.capacity}
    if args.html:
        t.save_html(args.html, device=args.device, **lines)
        print(f"wrote {args.html}")
    if args.png:
        t.save_memory_png(args.png, device=args.device, **lines)
        print(f"wrote {args.png}")
    if args.snapshot:
        t.save_memory_snapshot(args.snapshot)
        print(f"wrote {args.snapshot}")
    return 0


def _predict_job(args) -> int:
    import gpucast
    job, name = args.job, args.job
    if args.hf_config:
        if args.job or args.batch is None:
            raise ValueError("predict-job: --hf-config takes the job's settings (--batch, --seq-len, ...), not a "
                             "description file")
        job = gpucast.describe_config(args.hf_config, args.batch, seq_len=args.seq_len, dtype=args.dtype,
                                      optimizer=args.optimizer, grad_accumulation=args.grad_accumulation,
                                      activation_checkpointing=args.checkpointing, world_size=args.gpus,
                                      strategy=args.strategy, tp=args.tp, pp=args.pp,
                                      micro_batches=args.micro_batches, target=args.gpu or "")
        name = args.hf_config
    elif not args.job:
        raise ValueError("predict-job: give a job description file, or --hf-config with the job's settings")
    e = gpucast.predict_job(job, weights=args.weights)
    mib = 2**20
    print(f"{name}: {e['bytes'] / mib:,.1f} MiB per rank ({e['method']})")
    for k in ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "activation_bytes", "input_bytes"):
        print(f"  {k.replace('_bytes', ''):<12} {e[k] / mib:>12,.1f} MiB")
    for n in e["notes"]:
        print(f"  note: {n['text']}")
    return 0


def _plan(args) -> int:
    from . import _plan as plan
    return plan.run(args)


def _run_conf(conf: str, target: str | None) -> str:
    """GPUCAST_CONF for `run`: auto mode on, the user's other keys kept, and --target, when given, over theirs."""
    def key(item: str) -> str:
        return item.split(":", 1)[0].strip()
    drop = {"enabled"} | ({"target"} if target else set())
    kept = [x for x in conf.split(",") if x.strip() and key(x) not in drop]
    return ",".join(["enabled:True", *kept, *([f"target:{target}"] if target else [])])


def _run(args) -> int:
    if not args.command:
        print("python -m gpucast run: give the script after --, e.g. python -m gpucast run -- train.py --lr 0.1",
              file=sys.stderr)
        return 2
    os.environ["GPUCAST_CONF"] = _run_conf(os.environ.get("GPUCAST_CONF", ""), args.target)
    if args.log:
        os.environ["GPUCAST_LOG"] = args.log
    if args.save_trace:
        os.environ["GPUCAST_TRACE"] = args.save_trace
    import gpucast
    # `python -m gpucast` imported the package before this function set GPUCAST_CONF: read it again.
    gpucast._auto._reset()
    gpucast._auto.maybe_start()
    script, *rest = args.command
    sys.argv = [script, *rest]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:  # the script's own exit: report, then exit the same way
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    session = gpucast._auto.session()
    if session is not None and session.forecast is not None and not args.quiet:
        from ._results import Forecast
        print(str(Forecast(memory=session.forecast, probe_batch_sizes=(session.batch,), probe_device="",
                           context={})), file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpucast", description="gpucast: forecast GPU memory from one iteration")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a training script with auto mode on (GPUCAST_CONF enabled)")
    r.add_argument("--target", help="device table name or cpu, over GPUCAST_CONF's target (default: GPUCAST_CONF's, "
                                    "else auto); another name needs capacity_mb in GPUCAST_CONF")
    r.add_argument("--log", help="append forecasts to this JSON Lines file (GPUCAST_LOG)")
    r.add_argument("--save-trace", metavar="PATH", help="save the traced first iteration, as the forecast read it, to "
                                                        "PATH for `python -m gpucast report` (GPUCAST_TRACE)")
    r.add_argument("--quiet", action="store_true", help="do not print the forecast when the script ends")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- script.py args...")
    rep = sub.add_parser("report", help="summary of a saved trace; --html / --png / --snapshot write pictures")
    rep.add_argument("trace")
    rep.add_argument("--device", default="cpu", help="whose memory the pictures show (default cpu; cuda:0, ...)")
    rep.add_argument("--html", metavar="PATH", help="a self-contained HTML page: the summary and the memory timeline "
                                                    "(needs matplotlib)")
    rep.add_argument("--png", metavar="PATH", help="the memory timeline by category, with the phases, the peak, and "
                                                   "the --forecast and --capacity lines (needs matplotlib)")
    rep.add_argument("--snapshot", help="PyTorch memory-snapshot pickle for torch.cuda._memory_viz / memory_viz")
    rep.add_argument("--forecast", type=_size(False), metavar="SIZE",
                     help="draw a forecast peak line at SIZE on the pictures: bytes (1234567) or a number with a unit, "
                          "KiB/MiB/GiB/TiB (powers of 1024) or kB/MB/GB/TB (powers of 1000), e.g. 1234MiB, 2GiB")
    rep.add_argument("--capacity", type=_size(True), metavar="SIZE_OR_DEVICE",
                     help="draw a capacity line: a SIZE as for --forecast, or a device table name (H100-80GB: its "
                          "capacity; python -m gpucast devices)")
    sub.add_parser("devices", help="the device table")
    pj = sub.add_parser("predict-job", help="memory of a job from its description (gpucast.describe writes one)")
    pj.add_argument("job", nargs="?", help="a job description (JSON; gpucast.describe writes one)")
    pj.add_argument("--hf-config", metavar="CONFIG_JSON",
                    help="describe the job from a transformers config.json and the options below instead (no model "
                         "is built)")
    pj.add_argument("--batch", type=int, help="with --hf-config: the global batch size")
    pj.add_argument("--seq-len", type=int, help="with --hf-config: tokens per sample (text models)")
    pj.add_argument("--dtype", default="float32", help="parameter dtype: float32, bfloat16, float16 (float32)")
    pj.add_argument("--optimizer", default="adamw", help="sgd, sgd_momentum, adam, adamw, other (adamw)")
    pj.add_argument("--grad-accumulation", type=int, default=1, help="micro-steps per optimizer step (1)")
    pj.add_argument("--checkpointing", action="store_true", help="activation checkpointing of every layer")
    pj.add_argument("--gpus", type=int, default=1, help="every rank: data-parallel x tp x pp (1)")
    pj.add_argument("--strategy", default="single", help="data-parallel mode: single, ddp, zero1, zero2, fsdp")
    pj.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (1)")
    pj.add_argument("--pp", type=int, default=1, help="pipeline stages (1)")
    pj.add_argument("--micro-batches", type=int, default=1, help="pipeline micro-batches per step (1)")
    pj.add_argument("--gpu", help="the GPU (a device table name), recorded in the description")
    pj.add_argument("--weights", help="weights of the learned model (default: $GPUCAST_JOB_WEIGHTS, else the "
                                      "shipped ones); when they do not load, the analytical estimate answers")
    pl = sub.add_parser("plan", help="per-rank memory and step time of a model's layouts over N GPUs, from meta probes")
    pl.add_argument("config", help="a transformers config.json (built on the meta device, nothing downloaded), or "
                                   "module:function returning a model")
    pl.add_argument("--gpu", default="H100-80GB", help="the GPU (a device table name; another name with --capacity)")
    pl.add_argument("--capacity", type=_size(False), metavar="SIZE", help="the GPU's memory, for a GPU the table lacks")
    pl.add_argument("--gpus", type=int, required=True, help="how many GPUs the job runs on")
    pl.add_argument("--seq", type=int, required=True, help="tokens per sample")
    pl.add_argument("--batch", type=int, default=1, help="samples per data-parallel rank (default 1)")
    pl.add_argument("--tp", default="1", help="tensor-parallel sizes to consider, e.g. 1,2,8 (default 1)")
    pl.add_argument("--dp-modes", default="fsdp", help="data parallelism: fsdp, ddp or both, e.g. fsdp,ddp "
                                                       "(default fsdp)")
    pl.add_argument("--checkpointing", default="none,full", help="activation checkpointing: none, full or both "
                                                                 "(default none,full)")
    pl.add_argument("--dtype", default="bfloat16", help="parameters' dtype: bfloat16 (default), float16, float32")
    pl.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = p.parse_args(argv)
    if args.cmd == "run" and args.command and args.command[0] == "--":
        args.command = args.command[1:]
    try:
        return {"run": _run, "report": _report, "devices": _devices, "predict-job": _predict_job,
                "plan": _plan}[args.cmd](args)
    except (ValueError, OSError) as e:
        print(f"gpucast: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # an optional package that is not installed: one line naming it and its pip command
        if e.name not in OPTIONAL_PACKAGES:
            raise
        print(e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
