"""Memory forecasts far from the probes: forecast error at 2x, 8x and 32x the largest probe.

For each case (real architectures from torchvision, timm and transformers of 20 M parameters or more, built from
configurations here with random weights; mixture-of-experts decoders from transformers; and loop variants:
gradient accumulation, bf16 autocast, SGD with momentum, activation checkpointing), gpucast.forecast(target="cpu")
from the default probes (batch 2, 4, 8) forecasts the CPU-allocator bytes held at the run's peak at 2x, 8x and 32x
the largest probe (batch 16, 64, 256). A fresh process then builds the model and runs the real thing at that batch
for --iterations iterations, measuring the peak independently of gpucast from torch.profiler's memory events
recorded from before the model was built (as bench/memory_accuracy.py does). One thread per process; --jobs
measurements run side by side (each in its own process: the peaks do not depend on it).

Mixture-of-experts cases are measured twice: under random tokens, and with a test hook on every router's logits
(+10 on expert 0's) so that every token picks expert 0; the hook's measured share of tokens whose first choice is
expert 0 is printed. fc.memory.moe's expected peak is compared with the random-token run, and the forecast's peak
(the bound, moe_skew=1) with both.

32x runs only where the case's measured peak at 8x, times 4, fits in --max-gib (16 GiB): the cases left out are
listed. Signed error = (forecast - measured) / measured. Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]

RATIOS = (2, 8, 32)
LARGEST_PROBE = 8
SEQ = 32     # tokens per sequence of the language models
IMAGE = 64   # pixels per side of the vision models' images
VOCAB = 8192
VARIANTS = ("accumulate", "bf16", "sgd", "checkpoint")


def _vision(make):
    return {"kind": "vision", "make": make}


def _lm(make):
    return {"kind": "lm", "make": make}


def cases() -> dict:
    """name -> {"kind": vision | lm | classify | moe, "make": () -> nn.Module}. Sizes: 20 M parameters or more."""
    import timm
    import torchvision.models as tvm
    import transformers as tf

    def decoder(cls, config_cls, **kw):
        return lambda: cls(config_cls(vocab_size=VOCAB, max_position_embeddings=SEQ * 2, use_cache=False,
                                      attn_implementation="sdpa", **kw))
    llama_shape = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=4)
    return {
        "resnet50": _vision(lambda: tvm.resnet50(num_classes=10)),
        "convnext_tiny": _vision(lambda: tvm.convnext_tiny(num_classes=10)),
        "swin_t": _vision(lambda: tvm.swin_t(num_classes=10)),
        "vit_b_16": _vision(lambda: tvm.vit_b_16(image_size=IMAGE, num_classes=10)),
        "efficientnet_v2_s": _vision(lambda: tvm.efficientnet_v2_s(num_classes=10)),
        "timm_vit_small": _vision(lambda: timm.create_model("vit_small_patch16_224", pretrained=False, img_size=IMAGE,
                                                            num_classes=10)),
        "timm_mixer_b16": _vision(lambda: timm.create_model("mixer_b16_224", pretrained=False, img_size=IMAGE,
                                                            num_classes=10)),
        "hf_vit": _vision(lambda: _HFVision(tf.ViTForImageClassification(tf.ViTConfig(
            hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536, image_size=IMAGE,
            patch_size=8, num_labels=10, attn_implementation="sdpa")))),
        "gpt2": _lm(lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_positions=SEQ * 2, n_embd=512,
                                                             n_layer=8, n_head=8, use_cache=False,
                                                             attn_implementation="sdpa"))),
        "llama": _lm(decoder(tf.LlamaForCausalLM, tf.LlamaConfig, **llama_shape)),
        "qwen2": _lm(decoder(tf.Qwen2ForCausalLM, tf.Qwen2Config, **llama_shape)),
        "bert": {"kind": "classify", "make": lambda: tf.BertForSequenceClassification(tf.BertConfig(
            vocab_size=VOCAB, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, intermediate_size=2048,
            max_position_embeddings=SEQ * 2, num_labels=2, attn_implementation="sdpa"))},
        "mixtral": {"kind": "moe", "make": decoder(
            tf.MixtralForCausalLM, tf.MixtralConfig, hidden_size=256, intermediate_size=640, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
            router_jitter_noise=0.0)},
        # Wide experts, their activations well above the logits': where the routing moves the peak.
        "mixtral_wide": {"kind": "moe", "make": decoder(
            tf.MixtralForCausalLM, tf.MixtralConfig, hidden_size=256, intermediate_size=2048, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
            router_jitter_noise=0.0)},
        "qwen2_moe": {"kind": "moe", "make": decoder(
            tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig, hidden_size=256, intermediate_size=640,
            moe_intermediate_size=320, shared_expert_intermediate_size=640, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, num_experts=16, num_experts_per_tok=4)},
        "olmoe": {"kind": "moe", "make": decoder(
            tf.OlmoeForCausalLM, tf.OlmoeConfig, hidden_size=256, intermediate_size=320, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=8, num_experts=16, num_experts_per_tok=4)},
    }


class _HFVision:
    """transformers' image classifiers take pixel_values= and return an output object: forward(x) -> logits."""

    def __new__(cls, model):
        import torch.nn as nn

        class Wrapped(nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, x):
                return self.model(pixel_values=x).logits
        return Wrapped()


def _batch(kind: str):
    import torch

    def make(n: int):
        g = torch.Generator().manual_seed(0)
        if kind == "vision":
            return torch.randn(n, 3, IMAGE, IMAGE, generator=g), torch.randint(10, (n,), generator=g)
        tokens = torch.randint(VOCAB, (n, SEQ), generator=g)
        return tokens, (torch.randint(2, (n,), generator=g) if kind == "classify" else tokens)
    return make


def _loss(kind: str, model):
    import torch.nn.functional as F

    if kind == "vision":
        return lambda x, y: F.cross_entropy(model(x), y)
    if kind == "classify":
        return lambda x, y: F.cross_entropy(model(input_ids=x).logits, y)
    # Next-token cross entropy over every position.
    return lambda x, y: F.cross_entropy(model(input_ids=x).logits[:, :-1].flatten(0, 1), y[:, 1:].flatten())


def build(name: str, variant: str | None):
    """The case's model, optimizer, training step and make_batch, one thread, seeded."""
    import contextlib
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    case = cases()[name]
    model = case["make"]()
    if variant == "checkpoint":
        if hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            raise ValueError(f"{name}: no gradient_checkpointing_enable()")
    opt = (torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) if variant == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=1e-3))
    loss_of = _loss(case["kind"], model)
    autocast = ((lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if variant == "bf16"
                else contextlib.nullcontext)
    chunks = 2 if variant == "accumulate" else 1

    def step(batch):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(chunks), y.chunk(chunks)):
            with autocast():
                loss = loss_of(xs, ys) / chunks
            loss.backward()
        opt.step()
        return loss.detach()
    return model, opt, step, _batch(case["kind"])


def bias_routers(model) -> list:
    """Every router of `model` (a Linear named ...gate whose outputs are the experts) gets +10 on expert 0's logit:
    every token's first choice is expert 0. Returns the share of tokens whose first choice was expert 0, per call."""
    import torch
    shares = []

    def hook(_module, _inputs, out):
        out = out.clone()
        out[..., 0] += 10.0
        shares.append(float((out.argmax(-1) == 0).float().mean()))
        return out
    n_experts = {getattr(model.config, k) for k in ("num_local_experts", "num_experts") if hasattr(model.config, k)}
    hooked = 0
    for path, m in model.named_modules():
        if path.endswith("gate") and isinstance(m, torch.nn.Linear) and m.out_features in n_experts:
            m.register_forward_hook(hook)
            hooked += 1
    if hooked == 0:
        raise RuntimeError("no router found to bias")
    return shares


def measure(name, variant, batch, iterations, biased):
    """Fresh process: peak CPU-allocator bytes from before the model exists, over `iterations` iterations."""
    import torch
    from memory_accuracy import profiled_peak
    shares = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        model, opt, step, make_batch = build(name, variant)
        if biased:
            shares = bias_routers(model)
        for _ in range(iterations):
            b = make_batch(batch)
            step(b)
            del b
    return {"peak": profiled_peak(prof), "expert0_share": min(shares) if shares else None}


def run_child(args: list) -> dict:
    out = subprocess.run([sys.executable, __file__] + args, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed")
    return json.loads(out.stdout.strip().splitlines()[-1])


def forecast(name, variant, batch) -> dict:
    import gpucast
    import torch
    model, opt, step, make_batch = build(name, variant)
    params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    # One timing round: the step time is not what this bench measures, and the memory forecast does not read it.
    fc = gpucast.forecast(step, make_batch, batch, model=model, optimizer=opt, target="cpu", timing_rounds=1)
    wall = time.perf_counter() - t0
    m = fc.memory
    del model, opt, step
    torch.set_num_threads(1)
    return {"forecast_bytes": m.peak_allocated_bytes, "scaled": m.scaled, "params_m": round(params / 1e6, 1),
            "notes": sorted({n["code"] for n in m.notes} | {w["code"] for w in m.warnings}),
            "moe_forecast": m.moe, "forecast_s": round(wall, 1)}


def plan(args) -> list:
    """(case, variant, ratio) to run, in order."""
    names = args.cases.split(",")
    out = [(n, None, r) for n in names for r in RATIOS if r in args.ratios]
    for n in args.variant_cases.split(","):
        if n:
            out += [(n, v, r) for v in VARIANTS for r in RATIOS if r in args.ratios]
    return out


def err(f, m):
    return round(100.0 * (f - m) / m, 3)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="resnet50,convnext_tiny,swin_t,vit_b_16,efficientnet_v2_s,timm_vit_small,"
                                       "timm_mixer_b16,hf_vit,gpt2,llama,qwen2,bert,mixtral,mixtral_wide,qwen2_moe,"
                                       "olmoe",
                    help="comma-separated case names")
    ap.add_argument("--variant-cases", default="llama,resnet50",
                    help="cases also run with each loop variant (" + ", ".join(VARIANTS) + ")")
    ap.add_argument("--ratios", default="2,8,32", help="target batch over the largest probe (8), comma-separated")
    ap.add_argument("--iterations", type=int, default=3, help="measured iterations (>= 3)")
    ap.add_argument("--jobs", type=int, default=2, help="measurements run side by side")
    ap.add_argument("--max-gib", type=float, default=16.0, help="32x only where 4 x the 8x peak fits in this")
    ap.add_argument("--measure", nargs=4, metavar=("NAME", "VARIANT", "BATCH", "BIASED"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        name, variant, batch, biased = args.measure
        print(json.dumps(measure(name, None if variant == "-" else variant, int(batch), args.iterations,
                                 biased == "1")))
        return 0
    args.ratios = {int(r) for r in args.ratios.split(",")}
    if args.iterations < 3:
        ap.error(f"--iterations must be at least 3, got {args.iterations}")
    moe = {n for n, c in cases().items() if c["kind"] == "moe"}
    rows, skipped = [], []
    todo = plan(args)
    measured_8x = {}

    def measure_row(row, biased):
        return run_child(["--measure", row["case"], row["variant"] or "-", str(row["batch"]), "1" if biased else "0",
                          "--iterations", str(args.iterations)])

    print(f"{'case':<26} {'ratio':>4} {'batch':>4} {'params':>7} {'measured MiB':>10} {'gpucast MiB':>10} {'err %':>7}")
    # By ratio, so that 32x knows the 8x peaks; within a ratio, forecasts in this process, measurements side by side.
    for ratio in sorted(args.ratios):
        batch = ratio * LARGEST_PROBE
        group = []
        for name, variant, r in todo:
            if r != ratio:
                continue
            key = (name, variant)
            if ratio == 32 and key in measured_8x and 4 * measured_8x[key] > args.max_gib * 2**30:
                skipped.append({"case": name, "variant": variant, "ratio": ratio,
                                "why": f"4 x the 8x peak ({4 * measured_8x[key] / 2**30:.1f} GiB) > {args.max_gib} GiB"})
                continue
            row = {"case": name, "variant": variant, "ratio": ratio, "batch": batch, "moe": name in moe}
            print(f"forecasting {name}{'+' + variant if variant else ''} at {batch}", file=sys.stderr, flush=True)
            try:
                row.update(forecast(name, variant, batch))
            except Exception as e:  # noqa: BLE001 - a case that cannot be forecast is reported as such
                row["error"] = f"forecast: {type(e).__name__}: {str(e)[:120]}"
            group.append(row)
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            jobs = {}
            for row in group:
                if "error" in row:
                    continue
                jobs[pool.submit(measure_row, row, False)] = (row, "measured_bytes")
                if row["moe"]:
                    jobs[pool.submit(measure_row, row, True)] = (row, "measured_biased_bytes")
            for fut in concurrent.futures.as_completed(jobs):
                row, key = jobs[fut]
                try:
                    got = fut.result()
                    row[key] = got["peak"]
                    if key == "measured_biased_bytes":
                        row["expert0_share"] = got["expert0_share"]
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"measure: {str(e)[:160]}"
        for row in group:
            if "measured_bytes" in row:
                row["err_pct"] = err(row["forecast_bytes"], row["measured_bytes"])
                if ratio == 8:
                    measured_8x[(row["case"], row["variant"])] = row["measured_bytes"]
            moe_fc = row.get("moe_forecast")
            if moe_fc and "measured_bytes" in row:
                row["expected_err_pct"] = err(moe_fc["expected_peak_allocated_bytes"], row["measured_bytes"])
            if moe_fc and "measured_biased_bytes" in row:
                row["biased_err_pct"] = err(row["forecast_bytes"], row["measured_biased_bytes"])
            print_row(row)
            rows.append(row)
    summary = summarize(rows, skipped)
    print(json.dumps(summary))
    return 0


def print_row(row):
    name = row["case"] + (f"+{row['variant']}" if row["variant"] else "")
    if "error" in row:
        print(f"{name:<26} {row['ratio']:>3}x  {row['error']}", flush=True)
        return
    line = (f"{name:<26} {row['ratio']:>3}x {row['batch']:>4} {row['params_m']:>6.1f}M "
            f"{row['measured_bytes'] / 2**20:>10.2f} {row['forecast_bytes'] / 2**20:>10.2f} {row['err_pct']:>+7.2f}")
    if row["moe"] and not row.get("moe_forecast"):
        line += "  (no routed layer found)"
    elif row["moe"]:
        line += (f"  expected {row['moe_forecast']['expected_peak_allocated_bytes'] / 2**20:.2f} "
                 f"({row.get('expected_err_pct', float('nan')):+.2f} %), biased run "
                 f"{row.get('measured_biased_bytes', 0) / 2**20:.2f} (bound {row.get('biased_err_pct', float('nan')):+.2f} %, "
                 f"expert 0 first for {100 * (row.get('expert0_share') or 0):.0f} % of tokens)")
    print(line + ("  " + ",".join(row["notes"]) if row["notes"] else ""), flush=True)


def summarize(rows, skipped) -> dict:
    dense = [r for r in rows if not r["moe"] and "err_pct" in r]
    by_ratio = {}
    for ratio in RATIOS:
        errs = [r["err_pct"] for r in dense if r["ratio"] == ratio]
        if errs:
            by_ratio[str(ratio)] = {"cases": len(errs), "median_abs_err_pct": round(statistics.median(map(abs, errs)), 3),
                                    "max_abs_err_pct": round(max(map(abs, errs)), 3),
                                    "underestimates_beyond_1pct": sum(1 for e in errs if e < -1.0)}
    moe_rows = [r for r in rows if r["moe"] and "expected_err_pct" in r]
    moe = {"cases": len(moe_rows),
           "max_abs_expected_err_pct": round(max((abs(r["expected_err_pct"]) for r in moe_rows), default=0.0), 3),
           "bound_below_random": sum(1 for r in moe_rows if r["forecast_bytes"] < r["measured_bytes"]),
           "bound_below_biased": sum(1 for r in moe_rows if r["forecast_bytes"] < r.get("measured_biased_bytes", 0)),
           "not_found": sum(1 for r in rows if r["moe"] and not r.get("moe_forecast"))}
    return {"bench": "memory_reach", "by_ratio": by_ratio, "moe": moe, "skipped": skipped,
            "errors": [r for r in rows if "error" in r], "cases": rows}


if __name__ == "__main__":
    sys.exit(main())
