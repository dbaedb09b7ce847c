"""The job-level memory dataset: training jobs across model families, each with its job description and a label.

Every job is drawn from a seed (job i uses seed (SEED, i, attempt)), so the same seed gives the same rows. For
each job: count its training FLOPs per sample (on the meta device where the model allows), redraw configurations
too costly for this machine, build the model (random weights, one CPU thread), write its job description with
gpucast.describe(), then label it with the steady-state peak of CPU-allocator bytes over 2 training iterations at
the job's batch size (the first creates the optimizer state), measured here (label_source "measured"), or, where
the run would be too slow, with gpucast's trace-based forecast from probes at small batches (label_source
"forecast"). Every tenth measured job also gets the forecast, which checks forecast labels against measured ones
(`--check`). Jobs 0-2999 are drawn from the ranges in sample_config; jobs 3000 on from _sample_large (GiB peaks
that still run here).

The label is a CPU-memory proxy for the GPU's allocated bytes: same tensors, no caching-allocator rounding.
Columns gpu_allocated_bytes / gpu_reserved_bytes are null until the dataset is generated on a GPU.

Families: mlp, cnn (zoo CNN, torchvision and timm networks), rnn (LSTM/GRU/RNN), transformer-encoder (BERT and
DistilBERT configurations), transformer-decoder (zoo GPT and GPT-2 configurations), vit (timm VisionTransformer).
Varied: depth, width, batch, sequence length or image size, optimizer (SGD, SGD with momentum, Adam, AdamW),
precision (float32, bfloat16 weights, bfloat16 autocast), gradient accumulation and activation checkpointing.

Resumable: rows are appended to --out (JSON Lines) and jobs already there are skipped. `--gzip` writes the
compressed copy that is committed (bench/dataset/jobs.jsonl.gz). Progress bar on a terminal, quiet otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]
from gpucast._jsonl import append_record, read_records  # noqa: E402

SEED = 20261202
FAMILIES = ("mlp", "cnn", "rnn", "transformer-encoder", "transformer-decoder", "vit")
OPTIMIZERS = ("sgd", "sgd_momentum", "adam", "adamw")
ITERATIONS = 2            # measured iterations: the first creates the optimizer state, the second is steady
MEASURE_FLOPS = 3e9       # above this many FLOPs for 3 iterations at the job's batch, label by forecast
MAX_PROBE_FLOPS = 4e9     # above this for the forecast's probes, the job is redrawn
LARGE_FROM = 3000         # jobs from this index on are drawn large (see sample_config)
MAX_PARAMS = 250_000_000  # weights of one job (several GiB with Adam state)
MAX_LABEL = 12 * 2**30    # redraw jobs forecast above this (this machine has 24 GiB)


def _pick(rng, xs):
    return xs[int(rng.integers(len(xs)))]


def _log_int(rng, lo, hi):
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def sample_config(rng, family: str, large: bool = False) -> dict:
    """A job's configuration: the architecture, its sizes and the training settings. `large` draws jobs of GiB
    peaks that still run here: wide perceptrons and large-vocabulary embeddings at small batches (measured), and
    large batches of small networks (forecast)."""
    c: dict = {"family": family}
    if large:
        c.update(_sample_large(rng, family))
    elif family == "mlp":
        c.update(arch="mlp", in_features=_pick(rng, [32, 64, 128, 256, 512, 784, 1024, 2048, 4096]),
                 hidden=_log_int(rng, 64, 8192), depth=int(rng.integers(1, 9)),
                 classes=_pick(rng, [2, 10, 100, 1000]), batch=_log_int(rng, 1, 4096))
    elif family == "cnn":
        arch = _pick(rng, ["zoo_cnn", "zoo_cnn", "resnet18", "resnet34", "resnet50", "mobilenet_v2",
                           "mobilenet_v3_small", "mobilenet_v3_large", "squeezenet1_1", "efficientnet_b0",
                           "regnet_x_400mf", "convnext_atto", "vgg11"])
        c.update(arch=arch, image=_pick(rng, [32, 48, 64, 96, 128, 160, 224]), classes=_pick(rng, [10, 100, 1000]),
                 batch=_log_int(rng, 2, 256))
        if arch == "zoo_cnn":
            c["channels"] = [_log_int(rng, 8, 256) for _ in range(int(rng.integers(2, 6)))]
    elif family == "rnn":
        c.update(arch="rnn_lm", cell=_pick(rng, ["LSTM", "GRU", "RNN"]), vocab=_log_int(rng, 100, 16000),
                 embed=_log_int(rng, 16, 512), hidden=_log_int(rng, 16, 1024), layers=int(rng.integers(1, 5)),
                 bidirectional=bool(rng.random() < 0.25), head=_pick(rng, ["lm", "classify"]),
                 seq_len=_log_int(rng, 8, 256), batch=_log_int(rng, 1, 256))
    elif family == "transformer-encoder":
        heads = _pick(rng, [2, 4, 8, 12])
        c.update(arch=_pick(rng, ["bert", "distilbert"]), heads=heads, hidden=heads * _pick(rng, [16, 32, 64]),
                 layers=int(rng.integers(1, 9)), ffn_mult=_pick(rng, [2, 4]), vocab=_log_int(rng, 1000, 16000),
                 seq_len=_log_int(rng, 16, 384), batch=_log_int(rng, 1, 64), labels=_pick(rng, [2, 5, 100]))
    elif family == "transformer-decoder":
        heads = _pick(rng, [2, 4, 8, 12])
        c.update(arch=_pick(rng, ["zoo_gpt", "gpt2"]), heads=heads, hidden=heads * _pick(rng, [16, 32, 64]),
                 layers=int(rng.integers(1, 9)), vocab=_log_int(rng, 500, 16000), seq_len=_log_int(rng, 16, 384),
                 batch=_log_int(rng, 1, 64))
    elif family == "vit":
        heads = _pick(rng, [2, 3, 4, 6, 8])
        image = _pick(rng, [32, 64, 96, 128, 224])
        patch = _pick(rng, [p for p in (4, 8, 16, 32) if image % p == 0 and image // p >= 2])
        c.update(arch="vit", image=image, patch=patch, heads=heads, hidden=heads * _pick(rng, [16, 32, 64]),
                 layers=int(rng.integers(1, 13)), mlp_ratio=_pick(rng, [2.0, 4.0]),
                 classes=_pick(rng, [10, 100, 1000]), batch=_log_int(rng, 1, 256))
    else:
        raise ValueError(f"unknown family {family!r}")
    if large:
        c.update(precision="float32", optimizer=_pick(rng, ["adam", "adamw", "sgd_momentum"]), grad_accumulation=1,
                 checkpointing=False)
        return c
    r = rng.random()
    # bfloat16 weights only where this CPU's bfloat16 kernels are not far slower than float32 (not conv, not RNN).
    c["precision"] = "float32" if r < 0.6 else ("autocast_bf16" if r < 0.8 or family in ("cnn", "rnn") else "bfloat16")
    c["optimizer"] = _pick(rng, OPTIMIZERS)
    c["grad_accumulation"] = _pick(rng, [1, 1, 1, 1, 1, 2, 4]) if c["batch"] >= 4 else 1
    c["checkpointing"] = bool(c["arch"] in ("bert", "distilbert", "gpt2", "vit") and rng.random() < 0.2)
    return c


def _sample_large(rng, family: str) -> dict:
    if family == "mlp":
        return dict(arch="mlp", in_features=_pick(rng, [1024, 2048, 4096]), hidden=_log_int(rng, 3072, 8192),
                    depth=int(rng.integers(1, 4)), classes=_pick(rng, [10, 1000]), batch=_log_int(rng, 1, 8))
    if family == "cnn":
        return dict(arch=_pick(rng, ["zoo_cnn", "resnet18", "mobilenet_v3_small"]), image=_pick(rng, [32, 48, 64]),
                    classes=10, batch=_log_int(rng, 512, 4096), channels=[32, 64, 128])
    if family == "rnn":
        return dict(arch="rnn_lm", cell=_pick(rng, ["LSTM", "GRU"]), vocab=_log_int(rng, 200_000, 1_000_000),
                    embed=_pick(rng, [256, 512]), hidden=_log_int(rng, 64, 256), layers=1, bidirectional=False,
                    head="classify", seq_len=_log_int(rng, 8, 32), batch=_log_int(rng, 1, 8))
    if family == "transformer-encoder":
        heads = _pick(rng, [4, 8])
        return dict(arch=_pick(rng, ["bert", "distilbert"]), heads=heads, hidden=heads * 64,
                    layers=int(rng.integers(1, 3)), ffn_mult=2, vocab=_log_int(rng, 200_000, 600_000),
                    seq_len=_log_int(rng, 8, 32), batch=_log_int(rng, 1, 4), labels=2)
    if family == "transformer-decoder":
        heads = _pick(rng, [2, 4])
        return dict(arch="zoo_gpt", heads=heads, hidden=heads * 32, layers=int(rng.integers(1, 3)),
                    vocab=_log_int(rng, 2000, 8000), seq_len=_log_int(rng, 64, 256), batch=_log_int(rng, 256, 1024))
    heads = _pick(rng, [2, 3])
    return dict(arch="vit", image=32, patch=4, heads=heads, hidden=heads * 32, layers=int(rng.integers(1, 4)),
                mlp_ratio=2.0, classes=10, batch=_log_int(rng, 512, 4096))


def build(c: dict):
    """(model, make_batch(n), loss_fn) for a configuration; weights from torch's current seed."""
    import torch.nn.functional as F
    from examples import zoo

    arch = c["arch"]
    if arch == "mlp":
        model = zoo.MLP(c["in_features"], c["hidden"], c["depth"], c["classes"])
        make = zoo._classification_batch((c["in_features"],), c["classes"])
        loss = F.cross_entropy
    elif c["family"] == "cnn":
        import timm
        import torchvision.models as tvm
        if arch == "zoo_cnn":
            model = zoo.CNN(c["channels"], c["classes"])
        elif arch == "convnext_atto":
            model = timm.create_model("convnext_atto", pretrained=False, num_classes=c["classes"])
        else:
            model = getattr(tvm, arch)(num_classes=c["classes"])
        make = zoo._classification_batch((3, c["image"], c["image"]), c["classes"])
        loss = F.cross_entropy
    elif arch == "rnn_lm":
        model = RNNModel(c)
        if c["head"] == "lm":
            make, loss = zoo._next_token_batch(c["vocab"], c["seq_len"]), zoo._sequence_loss
        else:
            make, loss = zoo._token_batch(c["vocab"], c["seq_len"], num_labels=10), F.cross_entropy
    elif arch in ("bert", "distilbert"):
        from transformers import (BertConfig, BertForSequenceClassification, DistilBertConfig,
                                  DistilBertForSequenceClassification)
        if arch == "bert":
            cfg = BertConfig(vocab_size=c["vocab"], hidden_size=c["hidden"], num_hidden_layers=c["layers"],
                             num_attention_heads=c["heads"], intermediate_size=c["ffn_mult"] * c["hidden"],
                             max_position_embeddings=c["seq_len"], num_labels=c["labels"], attn_implementation="sdpa")
            inner = BertForSequenceClassification(cfg)
        else:
            cfg = DistilBertConfig(vocab_size=c["vocab"], dim=c["hidden"], n_layers=c["layers"], n_heads=c["heads"],
                                   hidden_dim=c["ffn_mult"] * c["hidden"], max_position_embeddings=c["seq_len"],
                                   num_labels=c["labels"], attn_implementation="sdpa")
            inner = DistilBertForSequenceClassification(cfg)
        if c["checkpointing"]:
            inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = zoo.HFLogits(inner)
        make, loss = zoo._token_batch(c["vocab"], c["seq_len"], num_labels=c["labels"]), F.cross_entropy
    elif arch == "zoo_gpt":
        model = zoo.GPT(c["vocab"], c["seq_len"], c["hidden"], c["heads"], c["layers"])
        make, loss = zoo._next_token_batch(c["vocab"], c["seq_len"]), zoo._sequence_loss
    elif arch == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        inner = GPT2LMHeadModel(GPT2Config(vocab_size=c["vocab"], n_positions=c["seq_len"], n_embd=c["hidden"],
                                           n_layer=c["layers"], n_head=c["heads"], use_cache=False,
                                           attn_implementation="sdpa"))
        if c["checkpointing"]:
            inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = zoo.HFLogits(inner)
        make, loss = zoo._token_batch(c["vocab"], c["seq_len"]), zoo._shifted_sequence_loss
    elif arch == "vit":
        from timm.models.vision_transformer import VisionTransformer
        model = VisionTransformer(img_size=c["image"], patch_size=c["patch"], embed_dim=c["hidden"],
                                  depth=c["layers"], num_heads=c["heads"], mlp_ratio=c["mlp_ratio"],
                                  num_classes=c["classes"])
        if c["checkpointing"]:
            model.set_grad_checkpointing(True)
        make, loss = zoo._classification_batch((3, c["image"], c["image"]), c["classes"]), F.cross_entropy
    else:
        raise ValueError(f"unknown arch {arch!r}")
    if c["precision"] == "bfloat16":
        model = model.to(torch.bfloat16)
        inner_make = make

        def make(n, _m=inner_make):
            x, y = _m(n)
            return (x.to(torch.bfloat16) if x.is_floating_point() else x), y
    return model, make, loss


class RNNModel(nn.Module):
    """Embedding, a stacked LSTM/GRU/RNN, and a head over every position ("lm") or the last one."""

    def __init__(self, c):
        super().__init__()
        self.embed = nn.Embedding(c["vocab"], c["embed"])
        self.rnn = getattr(nn, c["cell"])(c["embed"], c["hidden"], num_layers=c["layers"], batch_first=True,
                                          bidirectional=c["bidirectional"])
        width = c["hidden"] * (2 if c["bidirectional"] else 1)
        self.lm = c["head"] == "lm"
        self.head = nn.Linear(width, c["vocab"] if self.lm else 10)

    def forward(self, tokens):
        out, _ = self.rnn(self.embed(tokens))
        return self.head(out if self.lm else out[:, -1])


def make_optimizer(name, params):
    import torch
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.01)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.AdamW(params, lr=1e-3)


def make_step(model, opt, loss_fn, c):
    """One training iteration over a batch: `grad_accumulation` micro-batches, then the optimizer step."""
    import torch
    ga = c["grad_accumulation"]

    def ctx():
        return torch.autocast("cpu", dtype=torch.bfloat16) if c["precision"] == "autocast_bf16" else \
            contextlib.nullcontext()

    def step(batch):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(ga), y.chunk(ga)):
            with ctx():
                loss = loss_fn(model(xs), ys) / ga
            loss.backward()
        opt.step()
        return loss.detach()
    return step, ctx


def count_flops(c: dict, model=None, make=None) -> int:
    """FLOPs of one sample's training iteration: 3 x the forward's at batch 1 (torch.utils.flop_counter). Without
    a model, on the meta device, so that a configuration too costly for this machine is redrawn before anything
    is computed; models that cannot run there (some call .item() in forward) are counted on the CPU."""
    from torch.utils.flop_counter import FlopCounterMode
    device = "cpu"
    if model is None:
        device = "meta"
        with torch.device("meta"):
            model, make, _ = build(c)
    x, _ = make(1)
    model.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            model(x.to(device))
    finally:
        model.train()
    return 3 * int(fc.get_total_flops())


def run_job(index: int, seed: int, forecast_every: int, attempts: int = 60) -> dict:
    """Draw job `index` (redrawing configurations that cannot run here), describe it and label it."""
    import torch
    import gpucast
    torch.set_num_threads(1)
    family = FAMILIES[index % len(FAMILIES)]
    for attempt in range(attempts):
        rng = np.random.default_rng([seed, index, attempt])
        large = index >= LARGE_FROM
        c = sample_config(rng, family, large)
        ga = c["grad_accumulation"]
        built = None
        try:
            flops1 = count_flops(c)
        except Exception:  # noqa: BLE001 - count on the CPU
            torch.manual_seed(seed + index)
            held0 = torch.ops.gpucast.cpu_memory_stats(False)[0]
            try:
                built = build(c)
                flops1 = count_flops(c, built[0], built[1])
            except Exception as e:  # noqa: BLE001 - a configuration the library rejects is redrawn
                _note(f"job {index} attempt {attempt}: build failed ({type(e).__name__}: {str(e)[:100]}); redrawn")
                built = None
                continue
        probe_ok = flops1 * sum((2 * ga, 4 * ga, 8 * ga)) * 2 <= MAX_PROBE_FLOPS * (4 if large else 1)
        if not probe_ok and flops1 * c["batch"] * ITERATIONS > MEASURE_FLOPS:
            built = None
            continue
        if built is None:
            torch.manual_seed(seed + index)
            held0 = torch.ops.gpucast.cpu_memory_stats(False)[0]
            built = build(c)
        model, make, loss_fn = built
        built = None
        params = sum(p.numel() for p in model.parameters())
        if params > MAX_PARAMS:
            del model
            continue
        opt = make_optimizer(c["optimizer"], model.parameters())
        step, ctx = make_step(model, opt, loss_fn, c)
        probes = (2 * ga, 4 * ga, 8 * ga)
        run_flops = flops1 * c["batch"] * ITERATIONS
        measure = run_flops <= MEASURE_FLOPS
        row = {"id": index, "seed": seed, "attempt": attempt, "family": family, "config": c, "params": params,
               "flops_per_sample": flops1}
        try:
            with ctx():
                job = gpucast.describe(model, make, c["batch"], optimizer=opt, loss_fn=loss_fn, family=family,
                                       grad_accumulation=ga, activation_checkpointing=c["checkpointing"])
        except Exception as e:  # noqa: BLE001 - a kernel this CPU lacks (some bfloat16 RNNs)
            _note(f"job {index} attempt {attempt}: does not train ({type(e).__name__}: {str(e)[:100]}); redrawn")
            del model, opt, step
            continue
        job["autocast"] = c["precision"] == "autocast_bf16"
        row["job"] = job
        try:
            row.update(label(c, model, opt, step, make, measure, probe_ok, probes, held0, index, forecast_every))
        except Exception as e:  # noqa: BLE001 - e.g. BatchNorm over a micro-batch of one sample
            _note(f"job {index} attempt {attempt}: does not train ({type(e).__name__}: {str(e)[:100]}); redrawn")
            del model, opt, step
            continue
        del model, opt, step
        if row["label_bytes"] is None:
            continue
        return row
    raise RuntimeError(f"job {index}: no configuration of family {family} runs here in {attempts} attempts")


def label(c, model, opt, step, make, measure, probe_ok, probes, held0, index, forecast_every) -> dict:
    """The job's label: measured (2 iterations at its batch) or forecast; label_bytes None if it is too large."""
    import gpucast
    fc_bytes = None
    if not measure or (index % forecast_every == 0 and probe_ok):
        fc = gpucast.forecast(step, make, c["batch"], model=model, optimizer=opt, target="cpu",
                              probe_batch_sizes=probes, gnn=None)  # no step-time network: it would stay loaded
        fc_bytes = int(fc.memory.peak_allocated_bytes)
        if not measure and fc_bytes > MAX_LABEL:
            return {"label_bytes": None}
    measured = None
    if measure:
        torch.ops.gpucast.cpu_memory_stats(True)
        for _ in range(ITERATIONS):
            b = make(c["batch"])
            step(b)
            del b
        measured = int(torch.ops.gpucast.cpu_memory_stats(False)[1] - held0)
    return dict(label_bytes=measured if measure else fc_bytes, label_source="measured" if measure else "forecast",
                measured_bytes=measured, forecast_bytes=fc_bytes, gpu_allocated_bytes=None,
                gpu_reserved_bytes=None)


_QUIET = [False]


def _note(msg):
    if not _QUIET[0]:
        print(msg, file=sys.stderr)


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return list(read_records(str(path), gzip.open if path.suffix == ".gz" else open))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=3120, help="number of jobs (default 3120: 3000 + 120 large)")
    ap.add_argument("--first", type=int, default=0, help="first job index (default 0)")
    ap.add_argument("--seed", type=int, default=SEED, help=f"dataset seed (default {SEED})")
    ap.add_argument("--out", default=str(ROOT / "bench/dataset/jobs.jsonl"), help="rows, appended (JSON Lines)")
    ap.add_argument("--forecast-every", type=int, default=10,
                    help="also forecast every N-th measured job, to check forecast labels (default 10)")
    ap.add_argument("--gzip", action="store_true", help="then write OUT.gz sorted by job id")
    ap.add_argument("--check", action="store_true", help="only report forecast against measured labels in OUT")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.check:
        return check(read_rows(out) or read_rows(Path(str(out) + ".gz")))
    _QUIET[0] = args.quiet
    done = {r["id"] for r in read_rows(out)}
    todo = [i for i in range(args.first, args.first + args.jobs) if i not in done]
    bar = None
    if sys.stderr.isatty() and not args.quiet:
        from tqdm import tqdm
        bar = tqdm(total=len(todo), unit="job", desc="dataset")
    t0 = time.time()
    for n, i in enumerate(todo):
        append_record(str(out), run_job(i, args.seed, args.forecast_every))  # a new line after a torn one
        if bar is not None:
            bar.update(1)
        elif not args.quiet and (n + 1) % 100 == 0:
            print(f"dataset: {n + 1}/{len(todo)} jobs, {time.time() - t0:.0f} s", file=sys.stderr)
    if bar is not None:
        bar.close()
    if args.gzip:
        rows = sorted(read_rows(out), key=lambda r: r["id"])
        with gzip.open(str(out) + ".gz", "wt", encoding="utf-8", compresslevel=9) as g:
            for r in rows:
                g.write(json.dumps(r, separators=(",", ":")) + "\n")
    return 0


def check(rows: list[dict]) -> int:
    """Forecast labels against measured ones, on the jobs that have both."""
    both = [r for r in rows if r["measured_bytes"] is not None and r["forecast_bytes"] is not None]
    if not both:
        print("no job has both a measured and a forecast label")
        return 1
    errs = [100.0 * (r["forecast_bytes"] - r["measured_bytes"]) / r["measured_bytes"] for r in both]
    a = np.abs(errs)
    print(f"forecast vs measured labels on {len(both)} jobs: mean |error| {a.mean():.2f} %, median "
          f"{np.median(a):.2f} %, p95 {np.percentile(a, 95):.2f} %, max {a.max():.2f} %")
    print(json.dumps({"check": "forecast_labels", "jobs": len(both), "mean_abs_err_pct": round(float(a.mean()), 3),
                      "median_abs_err_pct": round(float(np.median(a)), 3),
                      "p95_abs_err_pct": round(float(np.percentile(a, 95)), 3), "max_abs_err_pct": round(float(a.max()), 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
