"""The GPU-job dataset: training jobs up to 70B parameters and 512 GPUs, each row labelled with gpucast's trace
forecast of one rank's peak allocated and reserved bytes on a GPU target (label_source "forecast-gpu").

Probes are shared. A *group* is one model with its training settings: architecture and sizes, precision, optimizer,
activation checkpointing and sequence length (or image size). Its probes run once (gpucast.forecast on the meta
device at batches 2, 3 and 4: no memory held, any size runs here); then Forecast.memory_at prices every row of the
group from those traces: a per-rank batch, a GPU (H100-80GB, A100-80GB, L4) and a parallel layout (single, DDP,
ZeRO-1/2, FSDP2 with each repeated block and the root a unit, tensor parallel x data parallel, pipeline x data
parallel with micro-batches) over 1 to 512 GPUs.

Families (random weights, configs written here, nothing downloaded):
  transformers decoders: llama, mistral (sliding window), qwen2, gpt2, mixtral (mixture of experts, tokens routed
  by the random router; the label is gpucast's routed bound); transformers encoders: bert (sequence
  classification), vit (image classification); torchvision CNNs (resnet, convnext, efficientnet, regnet, vgg).
Sizes: parameters drawn log-uniform from 10 M to 70 B for the transformer families. Precision: float32 or bfloat16
parameters (mixed precision is not probed on meta; see docs/user-guide.md). Optimizers: AdamW, SGD with momentum,
Adafactor. Checkpointing: none or every layer (transformers' gradient checkpointing).

Each output line is one group: {"group", "seed", "family", "arch", "hf_config" (the transformers fields, for
families built from one) or "tv" (torchvision name and sizes), "seq_len", "image", "precision", "optimizer",
"checkpointing", "params", "probe_seconds", "rows": [{"batch_per_rank", "gpu", "layout", "global_batch",
"allocated_bytes", "reserved_bytes", "approximate"}]}, or {"group", "error"} where the group could not be probed.
Group g draws from seed (SEED, g): the same seed gives the same groups. Resumable: groups already in --out are
skipped. `--gzip` writes the committed copy (bench/dataset/gpu_jobs.jsonl.gz).
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]
from gpucast._jsonl import append_record, read_records  # noqa: E402

SEED = 20261207
GPUS = ("H100-80GB", "A100-80GB", "L4")
WORLDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
ROWS_PER_GROUP = 64
FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "mixtral", "bert", "vit", "cnn")
VOCABS = (32000, 32768, 50257, 128256, 151936)
HIDDEN = (256, 384, 512, 768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192)


def _pick(rng, xs):
    return xs[int(rng.integers(len(xs)))]


def _decoder_config(rng, family: str, most: float = 7e10) -> dict:
    """transformers fields of a decoder of 10 M to `most` parameters (drawn log-uniform)."""
    target = 10 ** rng.uniform(7.0, math.log10(most))
    vocab = 50257 if family == "gpt2" else _pick(rng, VOCABS[:2] if family in ("mistral", "mixtral") else VOCABS)
    # A width near the usual one for that size, +-1 step: about 100 times as wide as deep, so params ~ 12 L h^2 ~
    # 0.12 h^3 (Llama 3: 2048 wide at 1 B, 4096 at 8 B, 8192 at 70 B).
    i = int(np.argmin([abs(math.log(h / (target / 0.12) ** (1 / 3))) for h in HIDDEN]))
    h = HIDDEN[int(np.clip(i + rng.integers(-1, 2), 0, len(HIDDEN) - 1))]
    head_dim = 64 if h < 2048 or family == "gpt2" else 128
    heads = max(1, h // head_dim)
    ffn = int(round(_pick(rng, [2.6875, 3.5, 4.0]) * h / 256)) * 256 if family != "gpt2" else 4 * h
    experts, top_k = (_pick(rng, [4, 8]), 2) if family == "mixtral" else (1, 1)
    per_layer = 4 * h * h + (3 if family != "gpt2" else 2) * h * ffn * experts
    layers = int(np.clip(round((target - 2 * vocab * h) / per_layer), 2, 128))
    if family == "gpt2":
        return dict(model_type="gpt2", vocab_size=vocab, n_embd=h, n_layer=layers, n_head=heads, n_inner=ffn)
    kv = _pick(rng, [heads, max(1, heads // 4), max(1, heads // 8)])
    c = dict(model_type=family, vocab_size=vocab, hidden_size=h, intermediate_size=ffn, num_hidden_layers=layers,
             num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=bool(h <= 2048 and rng.random() < .5))
    if family == "mixtral":
        c.update(num_local_experts=experts, num_experts_per_tok=top_k)
    if family == "mistral":
        c["sliding_window"] = 4096
    return c


def _encoder_config(rng, family: str) -> dict:
    h = _pick(rng, HIDDEN[:9])
    layers = int(rng.integers(2, 37))
    heads = max(1, h // 64)
    if family == "bert":
        return dict(model_type="bert", vocab_size=_pick(rng, [30522, 50265, 119547]), hidden_size=h,
                    num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=4 * h, num_labels=2)
    image = _pick(rng, [224, 224, 384])
    return dict(model_type="vit", hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                intermediate_size=4 * h, image_size=image, patch_size=_pick(rng, [14, 16, 32]) if image == 224 else 16,
                num_labels=1000)


def sample_group(rng, g: int) -> dict:
    family = FAMILIES[g % len(FAMILIES)]
    c: dict = {"family": family}
    if family in ("bert", "vit"):
        c["hf_config"] = _encoder_config(rng, family)
        c["seq_len"] = _pick(rng, [128, 256, 512]) if family == "bert" else 0
    elif family == "cnn":
        c["tv"] = _pick(rng, ["resnet18", "resnet50", "resnet101", "resnet152", "wide_resnet50_2", "convnext_tiny",
                               "convnext_base", "efficientnet_b0", "efficientnet_b4", "regnet_y_8gf", "vgg16",
                               "mobilenet_v3_large"])
        c["image"] = _pick(rng, [128, 224, 224, 320])
        c["seq_len"] = 0
    c["optimizer"] = _pick(rng, ["adamw", "adamw", "sgd_momentum", "adafactor"])
    # Where the step cannot run on meta (Adafactor and routed experts read values: .item(), nonzero), the probes run
    # on the CPU, at sizes this machine runs in seconds.
    c["probe"] = "cpu" if family == "mixtral" or c["optimizer"] == "adafactor" else "meta"
    if family in ("cnn", "bert", "vit") and c["probe"] == "cpu":
        c["optimizer"] = "adamw"  # their CPU probes would take minutes: Adafactor is drawn for decoders only
        c["probe"] = "meta"
    if family not in ("bert", "vit", "cnn"):
        small = c["probe"] == "cpu"
        c["hf_config"] = _decoder_config(rng, family, 1.5e8 if small else 7e10)
        c["seq_len"] = _pick(rng, [256, 512] if small else [512, 1024, 2048, 4096, 8192])
    c["precision"] = _pick(rng, ["bfloat16", "bfloat16", "float32"])
    c["checkpointing"] = bool(family not in ("cnn",) and rng.random() < 0.4)
    return c


def build(c: dict):
    """(model on meta or the CPU, optimizer, make_batch(n), step(batch), fsdp units)."""
    import torch.nn.functional as F
    dev = c["probe"]
    with torch.device(dev):
        if c["family"] == "cnn":
            import torchvision.models as tvm
            model = getattr(tvm, c["tv"])(num_classes=1000)
        else:
            from transformers import (AutoConfig, AutoModelForCausalLM, BertForSequenceClassification,
                                      ViTForImageClassification)
            fields = dict(c["hf_config"])
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
            config.use_cache = False
            # BERT's SDPA path asks whether its mask is all ones (.item()), which meta cannot answer: eager attention
            config._attn_implementation = "eager" if c["family"] == "bert" else "sdpa"
            cls = {"bert": BertForSequenceClassification, "vit": ViTForImageClassification}.get(c["family"])
            model = cls(config) if cls else AutoModelForCausalLM.from_config(config)
    model = model.to(getattr(torch, c["precision"]))
    if c["checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    params = list(model.parameters())
    opt = {"adamw": lambda: torch.optim.AdamW(params), "sgd_momentum": lambda: torch.optim.SGD(params, lr=.1, momentum=.9),
           "adafactor": lambda: torch.optim.Adafactor(params)}[c["optimizer"]]()
    dt = getattr(torch, c["precision"])
    seq, family = c["seq_len"], c["family"]
    vocab = int((c.get("hf_config") or {}).get("vocab_size", 2))

    def tokens(*shape):  # random tokens on the CPU (experts see real routing), any on meta
        return torch.randint(0, vocab, shape, device=dev)

    if family in ("cnn", "vit"):
        size = c["image"] if family == "cnn" else c["hf_config"]["image_size"]

        def make(n):
            return (torch.randn(n, 3, size, size, dtype=dt, device=dev),
                    torch.zeros(n, dtype=torch.long, device=dev))
    elif family == "bert":
        def make(n):
            return tokens(n, seq), torch.zeros(n, dtype=torch.long, device=dev)
    else:
        def make(n):
            return tokens(n, seq)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        if family == "cnn":
            F.cross_entropy(model(batch[0]), batch[1]).backward()
        elif family == "vit":
            model(pixel_values=batch[0], labels=batch[1]).loss.backward()
        elif family == "bert":
            # The mask a tokenizer gives (without one, BERT checks the inputs for padding: .item())
            model(input_ids=batch[0], attention_mask=torch.ones_like(batch[0]), labels=batch[1]).loss.backward()
        else:
            model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
    return model, opt, make, step, _units(model)


def _units(model) -> list:
    """FSDP2's units as recipes shard: every module of the classes that make up the longest ModuleList or Sequential
    (ModuleWrapPolicy's rule; where those are containers themselves, its elements), then the root."""
    lists = [m for m in model.modules() if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) and len(m) > 1]
    if not lists:
        return [model]
    blocks = max(lists, key=len)
    containers = (torch.nn.ModuleList, torch.nn.Sequential)
    if any(isinstance(b, containers) for b in blocks):
        return list(blocks) + [model]
    return sorted({type(b) for b in blocks}, key=lambda k: k.__name__) + [model]


def sample_row(rng, c: dict, units: list) -> tuple[int, str, dict]:
    """(per-rank batch, GPU, layout)."""
    world = _pick(rng, WORLDS)
    transformer = c["family"] != "cnn"
    kinds = ["ddp", "zero1", "zero2", "fsdp", "fsdp"] + (["tp", "pp"] if transformer and world >= 2 else [])
    kind = "single" if world == 1 else _pick(rng, kinds)
    layout: dict = {}
    if kind in ("ddp", "zero1", "zero2", "fsdp"):
        layout = {"dp": world, "dp_mode": kind}
    elif kind == "tp":
        tp = _pick(rng, [t for t in (2, 4, 8) if world % t == 0])
        layout = {"dp": world // tp, "tp": tp, "dp_mode": _pick(rng, ["ddp", "fsdp"])}
    elif kind == "pp":
        pp = _pick(rng, [p for p in (2, 4, 8) if world % p == 0])
        layout = {"dp": world // pp, "pp": pp, "micro_batches": pp * _pick(rng, [1, 2]), "dp_mode": "ddp"}
    per_rank = _pick(rng, [8, 16, 32, 64, 128, 256] if not c["seq_len"] else [1, 1, 2, 4, 8, 16])
    return per_rank, _pick(rng, GPUS), layout


def run_group(g: int, seed: int) -> dict:
    import gpucast
    rng = np.random.default_rng([seed, g])
    c = sample_group(rng, g)
    out = {"group": g, "seed": seed, **c}
    t0 = time.perf_counter()
    try:
        model, opt, make, step, units = build(c)
        out["params"] = sum(p.numel() for p in model.parameters())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fc = gpucast.forecast(step, make, 4, model=model, optimizer=opt, target="H100-80GB",
                                  probe_batch_sizes=(2, 3, 4))
    except Exception as e:  # noqa: BLE001 - a group the probes cannot run is recorded, not fatal
        out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return out
    out["probe_seconds"] = round(time.perf_counter() - t0, 2)
    rows = []
    for _ in range(ROWS_PER_GROUP):
        per_rank, gpu, layout = sample_row(rng, c, units)
        dp, mb = layout.get("dp", 1), layout.get("micro_batches", 1)
        par = dict(layout, fsdp_units=units) if layout.get("dp_mode") == "fsdp" else (layout or None)
        row = {"batch_per_rank": per_rank, "gpu": gpu, "layout": layout, "global_batch": per_rank * dp * mb}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m = fc.memory_at(row["global_batch"], target=gpu, parallel=par)
            row.update(allocated_bytes=m.peak_allocated_bytes, reserved_bytes=m.peak_reserved_bytes,
                       approximate=bool(m.approximate))
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    out["rows"] = rows
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def _layout_fields(row: dict) -> dict:
    lay = row["layout"]
    dp, tp, pp = lay.get("dp", 1), lay.get("tp", 1), lay.get("pp", 1)
    return {"batch_size": row["global_batch"], "world_size": dp * tp * pp, "tp": tp, "pp": pp,
            "micro_batches": lay.get("micro_batches", 1), "strategy": lay.get("dp_mode", "ddp") if dp > 1 else
            ("fsdp" if lay.get("dp_mode") == "fsdp" else "single"), "target": row["gpu"]}


def base_description(g: dict) -> dict:
    """The group's job description before its layout: from the transformers config (gpucast.describe_config, no
    model built), or for the CNNs from gpucast.describe on the meta device (one traced step at batch 2)."""
    import gpucast
    common = {"dtype": g["precision"], "optimizer": g["optimizer"], "activation_checkpointing": g["checkpointing"]}
    if "hf_config" in g:
        return gpucast.describe_config(g["hf_config"], 1, seq_len=g["seq_len"] or None,
                                       attn_implementation="eager" if g["family"] == "bert" else "sdpa", **common)
    import torch.nn.functional as F
    import torchvision.models as tvm
    with torch.device("meta"):
        model = getattr(tvm, g["tv"])(num_classes=1000)
    model = model.to(getattr(torch, g["precision"])).train()
    dt, size = getattr(torch, g["precision"]), g["image"]
    job = gpucast.describe(model, lambda n: (torch.empty(n, 3, size, size, dtype=dt, device="meta"),
                                             torch.zeros(n, dtype=torch.long, device="meta")), 1,
                           loss_fn=F.cross_entropy, probe_batch=2)
    return dict(job, optimizer=g["optimizer"])


def training_rows(groups: list[dict]) -> list[dict]:
    """One labelled job per priced row: {"job" (schema 2), "label_bytes" (allocated), "label_reserved_bytes",
    "label_source": "forecast-gpu", "family", "params", "group", "approximate"}."""
    out = []
    for g in groups:
        if "error" in g:
            continue
        base = base_description(g)
        for r in g["rows"]:
            if "error" in r:
                continue
            out.append({"job": dict(base, **_layout_fields(r)), "label_bytes": r["allocated_bytes"],
                        "label_reserved_bytes": r["reserved_bytes"], "label_source": "forecast-gpu",
                        "family": g["family"], "params": g["params"], "group": g["group"],
                        "approximate": r["approximate"]})
    return out


def read_groups(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return list(read_records(str(path), gzip.open if path.suffix == ".gz" else open))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--first", type=int, default=0, help="first group index")
    ap.add_argument("--groups", type=int, default=320, help="groups to generate (64 rows each)")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "dataset" / "gpu_jobs.jsonl")
    ap.add_argument("--gzip", action="store_true", help="also write OUT.gz (the committed copy)")
    args = ap.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    done = {r["group"] for r in read_groups(args.out)}
    todo = [g for g in range(args.first, args.first + args.groups) if g not in done]
    from gpucast._probes import Progress
    progress = Progress(stream=sys.stderr) if sys.stderr.isatty() else None
    t0 = time.perf_counter()
    for i, g in enumerate(todo, 1):
        if progress:
            progress.show(f"group {i} of {len(todo)} ({time.perf_counter() - t0:.0f} s)")
        append_record(str(args.out), run_group(g, args.seed))
    if progress:
        progress.done()
    groups = sorted({x["group"]: x for x in read_groups(args.out)}.values(), key=lambda x: x["group"])  # one each
    if args.gzip:  # in group order, no timestamp: the same groups give the same bytes
        tmp = Path(str(args.out) + ".gz.tmp")
        with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as z:
            for x in groups:
                z.write((json.dumps(x, separators=(",", ":")) + "\n").encode())
        tmp.replace(str(args.out) + ".gz")
    rows = sum(len([r for r in x.get("rows", []) if "error" not in r]) for x in groups)
    print(f"{len(groups)} groups, {rows} rows, {sum('error' in x for x in groups)} groups failed -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
