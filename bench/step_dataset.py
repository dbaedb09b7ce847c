"""The step-time dataset gpucast's graph network is trained on, and that bench/scaledl_compare.py splits.

For every case (an architecture family, a size variant, an optimizer and a target batch) this script runs
gpucast.forecast(target="cpu") from probes at batch 2, 4 and 8 (one thread; plus timing probes at 16 and 24 where
the probes' convolutions ran PyTorch's CPU im2col path), and measures the real step at the
target batch in the same process as bench/step_time_accuracy.py does (the median of --iterations: half of them
before the forecast on the same model built again, half after, each half after 3 warm-up steps). One JSON line per case:

  family, model, batch, optimizer, threads, device peak rates (measured here: a large float32 matmul and a large
  copy), the layer graph at the target batch (nodes: kind, forward FLOPs and bytes, forecast ms; edges: bytes
  passed), the forecast (sum of layer times, optimizer, other; and the sum from the first of the probes' timing
  rounds alone, first_round_sum_layers_ms, null where they ran one round), the probes' per-layer measurements (what a
  per-layer regressor learns from) and their iteration timings as gpucast records them (to forecast again, e.g.
  with sparse timing), and the measured step (median and interquartile range).

Families: GPT-2, BERT and T5 (transformers), ViT and DeiT (timm), ResNet and MobileNet (torchvision), ConvNeXt
(timm), and gpucast's zoo MLP, CNN, LSTM and GPT; several widths and depths each; nothing is downloaded.

    python bench/step_dataset.py --out FILE.jsonl.gz   (112 cases, about 14 minutes on the 2-core machine)
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import statistics
import sys
import time
from pathlib import Path

import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]


def variants():
    """(family, model name, builder, make_batch, loss) for every size variant."""
    import timm
    import torch.nn.functional as F
    import torchvision.models as tvm
    from transformers import (BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel, T5Config,
                              T5ForConditionalGeneration)
    from examples import zoo
    cls = zoo._classification_batch
    tok = zoo._token_batch
    out = []
    for h, n in ((64, 2), (128, 2), (128, 4), (192, 3)):
        out.append(("gpt2", f"gpt2_h{h}_l{n}", lambda h=h, n=n: zoo.HFLogits(GPT2LMHeadModel(GPT2Config(
            vocab_size=1000, n_positions=64, n_embd=h, n_layer=n, n_head=4, use_cache=False,
            attn_implementation="sdpa"))), tok(1000, 32), zoo._shifted_sequence_loss))
        out.append(("bert", f"bert_h{h}_l{n}", lambda h=h, n=n: zoo.HFLogits(BertForSequenceClassification(BertConfig(
            vocab_size=1000, hidden_size=h, num_hidden_layers=n, num_attention_heads=4, intermediate_size=2 * h,
            max_position_embeddings=128, num_labels=2, attn_implementation="sdpa"))), tok(1000, 32, num_labels=2),
            F.cross_entropy))
    for d, n in ((64, 2), (128, 2), (128, 3)):
        out.append(("t5", f"t5_d{d}_l{n}", lambda d=d, n=n: T5Seq2Seq(T5ForConditionalGeneration(T5Config(
            vocab_size=1000, d_model=d, d_kv=d // 4, d_ff=2 * d, num_layers=n, num_heads=4, decoder_start_token_id=0,
            use_cache=False))), tok(1000, 32), zoo._shifted_sequence_loss))
    for d, n in ((96, 4), (192, 4), (192, 8)):
        out.append(("vit", f"vit_d{d}_l{n}", lambda d=d, n=n: timm.models.vision_transformer.VisionTransformer(
            img_size=64, patch_size=16, embed_dim=d, depth=n, num_heads=3, num_classes=10), cls((3, 64, 64)),
            F.cross_entropy))
    for name in ("deit_tiny_patch16_224",):
        for img in (32, 64):
            out.append(("deit", f"deit_tiny_{img}", lambda name=name, img=img: timm.create_model(
                name, pretrained=False, img_size=img, num_classes=10), cls((3, img, img)), F.cross_entropy))
    for name, img in (("resnet18", 32), ("resnet18", 64), ("resnet34", 32)):
        out.append(("resnet", f"{name}_{img}", lambda name=name: getattr(tvm, name)(num_classes=10), cls((3, img, img)),
                    F.cross_entropy))
    for name, img in (("mobilenet_v3_small", 64), ("mobilenet_v2", 32), ("mobilenet_v3_large", 32)):
        out.append(("mobilenet", f"{name}_{img}", lambda name=name: getattr(tvm, name)(num_classes=10),
                    cls((3, img, img)), F.cross_entropy))
    for name in ("convnext_atto", "convnext_femto"):
        out.append(("convnext", name, lambda name=name: timm.create_model(name, pretrained=False, num_classes=10),
                    cls((3, 64, 64)), F.cross_entropy))
    for name in ("mlp", "cnn", "lstm", "gpt"):
        case = zoo.CASES[name]
        out.append((f"zoo_{name}", name, case.make_model, case.make_batch, case.loss_fn))
    return out


class T5Seq2Seq(nn.Module):
    """T5 on token ids (the decoder reads the same ids), returning logits like the other token models."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, decoder_input_ids=ids).logits


def record(family, name, make_model, make_batch, loss_fn, optimizer, batch, iterations, rates) -> dict:
    import torch
    import gpucast
    from examples import zoo
    from step_time_accuracy import bracketed  # the same measurement as the accuracy bench

    def build():
        torch.manual_seed(0)
        model = make_model()
        opt = zoo.make_optimizer(optimizer, model.parameters())
        return model, opt, zoo.make_step(model, opt, loss_fn)

    fc, model, measured, iqr, _ = bracketed(
        build, make_batch, batch, iterations,
        lambda model, opt, step: gpucast.forecast(step, make_batch, batch, model=model, optimizer=opt, target="cpu",
                                                  gnn=None))
    t = fc.time
    # The same forecast from the first of the probes' timing rounds alone (what one round gives: the recordings
    # made before the rounds), beside the forecast from their median.
    first = (dataclasses.replace(fc, timings=fc.timing_rounds[0]).step_time(batch, gnn=None).compute_ms
             if fc.timing_rounds else None)
    probes = [json.loads(x) for x in fc.timings]
    # The graph exactly as the forecast builds it for the network (C++: forecast_step_graph), from the same probes.
    g = json.loads(torch.ops.gpucast.forecast_step_time(list(fc.timings), batch, optimizer=optimizer,
                                                        threads=torch.get_num_threads(), output="graph", **rates))
    return {"family": family, "model": name, "batch": batch, "optimizer": optimizer, "global": g["global"],
            "nodes": g["nodes"], "edges": g["edges"],
            "sum_layers_ms": g["sum_layers_ms"], "comm_ms": g["comm_ms"], "optimizer_ms": t.optimizer_ms,
            "timing_rounds": len(fc.timing_rounds) or 1, "first_round_sum_layers_ms": first,
            "other_ms": t.other_ms,
            "measured_ms": round(measured, 4), "measured_iqr_ms": round(iqr, 4),
            "params": sum(p.numel() for p in model.parameters()),
            "timings": list(fc.timings),
            "probes": [{"batch": p["batch"], "optimizer_ns": p["optimizer_ns"], "other_ns": p["other_ns"],
                        "layers": [{"kind": x.get("cost_kind", x["kind"]), "flops": x.get("flops", 0.0),
                                    "bytes": x.get("bytes", 0.0), "forward_ns": x["forward_ns"],
                                    "backward_ns": x["backward_ns"]} for x in p["layers"]]} for p in probes]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the recording to write (gzipped JSON Lines); the committed ones "
                    "are bench/dataset/step_times.jsonl.gz to step_times_4.jsonl.gz (scaledl_compare.py --data)")
    ap.add_argument("--batches", default="16,32")
    ap.add_argument("--optimizers", default="adamw,sgd")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--only", default="", help="comma-separated families")
    args = ap.parse_args()
    import torch
    import warnings
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from gpucast._settings import cpu_rates
    rates = cpu_rates()
    print(f"device: {rates}", file=sys.stderr)
    only = set(args.only.split(",")) if args.only else None
    n = 0
    t_start = time.time()
    with gzip.open(args.out, "wt", encoding="utf-8") as f:
        for family, name, make_model, make_batch, loss_fn in variants():
            if only and family not in only:
                continue
            for optimizer in args.optimizers.split(","):
                for batch in [int(b) for b in args.batches.split(",")]:
                    row = record(family, name, make_model, make_batch, loss_fn, optimizer, batch, args.iterations,
                                 rates)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    n += 1
                    err = 100 * (row["sum_layers_ms"] - row["measured_ms"]) / row["measured_ms"]
                    print(f"{time.time() - t_start:7.1f}s {family:<10} {name:<22} {optimizer:<5} b{batch:<3} "
                          f"measured {row['measured_ms']:8.2f} ms, forecast {row['sum_layers_ms']:8.2f} ({err:+.1f} %)"
                          + (f"; first timing round alone "
                             f"{100 * (row['first_round_sum_layers_ms'] / row['measured_ms'] - 1):+.1f} %"
                             if row["first_round_sum_layers_ms"] is not None else ""),
                          file=sys.stderr, flush=True)
    print(json.dumps({"bench": "step_dataset", "cases": n, "device": rates}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
