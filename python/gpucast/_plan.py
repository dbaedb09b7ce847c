"""python -m gpucast plan: which layouts of a model over a number of GPUs fit, and how fast each runs, forecast from
probes on the meta device (no memory held: any size plans on this machine).

The model comes from a transformers config.json (built on meta with random init, nothing downloaded) or a
`module:function` returning a transformers model; the job is a causal language model's step as transformers' Trainer
runs it (the model's own loss from `labels=`, AdamW).
Each layout is dp x tp (x the checkpointing mode), dp's mode DDP or FSDP2 (FSDP2: every decoder layer and the root a
unit, FSDP2's rule), tp by the coarse rule (flagged approximate). The probes run once per checkpointing mode; every
layout is priced from them (Forecast.memory_at and Forecast.step_time)."""
from __future__ import annotations

import json
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from ._probes import Progress


@dataclass
class Layout:
    dp: int
    tp: int
    dp_mode: str
    checkpointing: str  # "none" or "full"

    def name(self) -> str:
        tp = f" x tp{self.tp}" if self.tp > 1 else ""
        return f"{self.dp_mode}{self.dp}{tp}" + (", ckpt" if self.checkpointing == "full" else "")


def _ints(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"plan: --{what} takes integers separated by commas, got {text!r}") from None
    if not out or any(x < 1 for x in out):
        raise ValueError(f"plan: --{what} takes integers of at least 1, got {text!r}")
    return out


def layouts(gpus: int, tp_sizes: str, dp_modes: str, checkpointing: str) -> list[Layout]:
    """Every layout asked for; ValueError naming the option and value for one that does not fill `gpus`."""
    if gpus < 1:
        raise ValueError(f"plan: --gpus must be at least 1, got {gpus}")
    modes = [m.strip() for m in dp_modes.split(",") if m.strip()]
    for m in modes:
        if m not in ("ddp", "fsdp"):
            raise ValueError(f"plan: --dp-modes takes ddp and fsdp, got {m!r}")
    ckpts = [c.strip() for c in checkpointing.split(",") if c.strip()]
    for c in ckpts:
        if c not in ("none", "full"):
            raise ValueError(f"plan: --checkpointing takes none and full, got {c!r}")
    out = []
    for tp in _ints(tp_sizes, "tp"):
        if gpus % tp:
            raise ValueError(f"plan: --tp {tp} does not divide --gpus {gpus}: the layout dp x tp must be {gpus} GPUs")
        for mode in modes:
            for c in ckpts:
                out.append(Layout(gpus // tp, tp, mode, c))
    return out


def model_from_config(path: str) -> Callable[[], torch.nn.Module]:
    """A function building the causal language model a transformers config.json describes (AutoConfig.for_model of
    its model_type; SDPA attention, no cache), or `module:function` returning a model. ValueError naming the file
    and what is wrong."""
    if ":" in path and not path.endswith(".json"):
        import importlib
        mod, fn = path.split(":", 1)
        return getattr(importlib.import_module(mod), fn)
    try:
        with open(path, encoding="utf-8") as f:
            fields = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"plan: cannot read the config {path}: {e}") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ValueError(f"plan: {path}: field 'model_type' missing (a transformers config.json names its "
                         f"architecture there, e.g. \"llama\")")
    from transformers import AutoConfig, AutoModelForCausalLM
    kind = fields.pop("model_type")
    try:
        config = AutoConfig.for_model(kind, **fields)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"plan: {path}: transformers cannot build a config of model_type {kind!r}: {e}") from None
    config.use_cache = False
    config._attn_implementation = "sdpa"

    def build() -> torch.nn.Module:
        try:
            return AutoModelForCausalLM.from_config(config)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"plan: {path}: transformers cannot build a causal language model from it: {e}") from None
    return build


def _units(model: torch.nn.Module) -> list:
    """FSDP2's units as torchtitan and most recipes shard: each repeated block (the classes of the largest
    ModuleList's elements), then the root."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not lists:
        return [model]
    blocks = max(lists, key=len)
    return sorted({type(b) for b in blocks}, key=lambda c: c.__name__) + [model]


def _job(build: Callable[[], torch.nn.Module], checkpointing: str, dtype: str):
    """The model on meta, its optimizer and the training step (a causal LM's, as transformers' Trainer runs it)."""
    with torch.device("meta"):
        model = build()
    model = model.to(getattr(torch, dtype))
    if checkpointing == "full":
        if not hasattr(model, "gradient_checkpointing_enable"):
            raise ValueError("plan: --checkpointing full needs a transformers model (gradient_checkpointing_enable)")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters())

    def step(x: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        # The model's own loss, as transformers' Trainer computes it (labels shifted inside; its cross entropy upcasts
        # the logits to float32); the output, logits included, let go before backward.
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
    return model, opt, step


def plan_layouts(build: Callable[[], torch.nn.Module], layouts: list[Layout], seq: int, batch: int, gpu: str,
                 dtype: str, capacity: int | None) -> list[dict]:
    """Layouts of one checkpointing mode from one set of meta probes (Forecast.memory_at and step_time price each):
    per-rank memory, whether it fits, step time, tokens/s per GPU."""
    from . import forecast
    t0 = time.perf_counter()
    model, opt, step = _job(build, layouts[0].checkpointing, dtype)
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
    units = _units(model)

    def parallel(layout: Layout) -> dict[str, Any]:
        p: dict[str, Any] = {"dp": layout.dp, "tp": layout.tp, "dp_mode": layout.dp_mode}
        if layout.dp_mode == "fsdp":
            p["fsdp_units"] = units
        return p
    rows = []
    fc = None
    for layout in layouts:
        t1 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if fc is None:
                fc = forecast(step, lambda n: torch.empty(n, seq, dtype=torch.long, device="meta"), batch * layout.dp,
                              model=model, optimizer=opt, target=gpu, capacity=capacity, parallel=parallel(layout),
                              probe_batch_sizes=(2, 3, 4))
                m, tf = fc.memory, fc.time
            else:
                m = fc.memory_at(batch * layout.dp, parallel=parallel(layout), capacity=capacity)
                tf = fc.step_time(batch * layout.dp, parallel=parallel(layout)) if fc.time else None
        said = [str(w.message) for w in caught] + [f"gpucast.forecast: {w['text']}" for w in m.warnings]
        step_ms = tf.step_ms if tf else None
        rows.append({"layout": asdict(layout), "name": layout.name(), "allocated_bytes": m.peak_allocated_bytes,
                     "reserved_bytes": m.peak_reserved_bytes, "capacity_bytes": m.capacity_bytes,
                     "fits": m.peak_reserved_bytes <= m.capacity_bytes, "approximate": bool(m.approximate),
                     "max_global_batch": m.max_batch_size, "step_ms": step_ms,
                     "tokens_per_s_per_gpu": batch * seq / layout.tp / (step_ms / 1e3) if step_ms else None,
                     "vocab": vocab, "seconds": time.perf_counter() - (t0 if len(rows) == 0 else t1),
                     "warnings": list(dict.fromkeys(said))})
    return rows


def ranked(rows: list[dict]) -> list[dict]:
    """Layouts that fit first, fastest first; then those that do not, smallest reserved peak first."""
    return sorted(rows, key=lambda r: (not r["fits"], r["step_ms"] if r["fits"] and r["step_ms"] else float("inf"),
                                       r["reserved_bytes"]))


def table(rows: list[dict]) -> str:
    gib = 2**30
    lines = [f"{'layout':<22}{'allocated GiB':>14}{'reserved GiB':>13}{'fits':>6}{'step ms':>10}{'tokens/s/GPU':>14}"]
    for r in rows:
        lines.append(f"{r['name'] + (' ~' if r['approximate'] else ''):<22}{r['allocated_bytes'] / gib:>14.2f}"
                     f"{r['reserved_bytes'] / gib:>13.2f}{'yes' if r['fits'] else 'NO':>6}"
                     f"{r['step_ms'] or 0:>10.1f}{r['tokens_per_s_per_gpu'] or 0:>14,.0f}")
    if any(r["approximate"] for r in rows):
        lines.append("~ tensor parallelism by the coarse rule (not yet matched to PyTorch's): approximate")
    return "\n".join(lines)


def run(args) -> int:
    capacity = args.capacity
    # The one rule for a target's name (ValueError listing the table's names for an unknown one without a capacity).
    args.gpu = torch.ops.gpucast.check_target(str(args.gpu), capacity or 0)
    if args.gpu == "cpu":
        raise ValueError("plan: --gpu must be a GPU (python -m gpucast devices lists them), not cpu")
    if args.seq < 2 or args.batch < 1:
        raise ValueError(f"plan: --seq must be at least 2 and --batch at least 1, got {args.seq} and {args.batch}")
    if args.dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"plan: --dtype takes bfloat16, float16 or float32, got {args.dtype!r}")
    todo = layouts(args.gpus, args.tp, args.dp_modes, args.checkpointing)
    build = model_from_config(args.config)
    progress = Progress(delay_s=0.0)
    rows = []
    modes = list(dict.fromkeys(x.checkpointing for x in todo))
    for i, mode in enumerate(modes, 1):  # one set of probes per checkpointing mode, every layout priced from it
        group = [x for x in todo if x.checkpointing == mode]
        progress.show(f"probes {i} of {len(modes)} (checkpointing {mode}, {len(group)} layouts)")
        rows += plan_layouts(build, group, args.seq, args.batch, args.gpu, args.dtype, capacity)
    progress.done()
    rows = ranked(rows)
    if args.json:
        print(json.dumps({"gpu": args.gpu, "gpus": args.gpus, "seq": args.seq, "batch_per_rank": args.batch,
                          "dtype": args.dtype, "layouts": rows}))
    else:
        print(f"{args.config}: {args.gpus} x {args.gpu}, {args.batch} x {args.seq} tokens per rank, {args.dtype}, "
              f"AdamW (forecast from meta probes)")
        print(table(rows))
    return 0
