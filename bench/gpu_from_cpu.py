"""A GPU's training step forecast from probes on this machine's CPU, against the step NeuSight measured on that GPU.

gpucast.forecast(target=<GPU>) with CPU probes prices every layer from the probes' work (FLOPs and bytes per op
kind and precision) at the GPU's rates in gpucast's table (bench/gpu_rates.py fits it on NeuSight's per-operator
latencies). Here the whole path runs as a user runs it: the real Hugging Face architecture built from its
configuration with random weights (eager attention and float32, as NeuSight measured them with PyTorch 2.1),
probes at batch 1 and 2 traced on the CPU, then the forward and backward of the step forecast at NeuSight's
batch sizes for every GPU it measured, compared with NeuSight's measured iteration (e2e_latency: forward and
backward; its optimizer step is not in it, so gpucast's optimizer time is left out of the comparison and printed
apart).

The rates table is fitted on all of NeuSight's per-operator rows, these models' included: this checks the path
from a CPU trace to a GPU step (what the tracer records of a real model, the batch extrapolation of the work,
pricing per op kind) rather than the table's generalisation, which bench/gpu_rates.py measures with whole model
families held out.

    python bench/gpu_from_cpu.py [--models bert_large]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]
NEUSIGHT = ROOT.parent / "shared" / "data" / "neusight"
GPUS = {"NVIDIA_H100_80GB_HBM3": "H100-80GB", "NVIDIA_A100_80GB_PCIe": "A100-80GB", "NVIDIA_L4": "L4",
        "Tesla_V100-PCIE-32GB": "V100-32GB"}


def build(name: str):
    import torch
    import transformers as tf
    torch.manual_seed(0)
    if name == "bert_large":
        cfg = tf.BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                            attn_implementation="eager")
        model, seq, vocab = tf.BertForPreTraining(cfg), 512, cfg.vocab_size
    else:  # GPT-2 large at 1,024 tokens (774M parameters) was tried: its probe does not fit in 24 GiB
        raise SystemExit(f"gpu_from_cpu: unknown model {name!r} (bert_large)")
    model.train()
    return model, seq, vocab


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="bert_large")
    args = ap.parse_args()
    import torch
    import gpucast
    torch.set_num_threads(2)
    rows = []
    for name in args.models.split(","):
        model, seq, vocab = build(name)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def make_batch(n: int):
            return torch.randint(0, vocab, (n, seq))

        def step(ids):
            opt.zero_grad(set_to_none=True)
            out = model(input_ids=ids)
            logits = out.prediction_logits if hasattr(out, "prediction_logits") else out.logits
            logits.float().mean().backward()
            opt.step()
        t0 = time.perf_counter()
        fc = gpucast.forecast(step, make_batch, batch_size=2, model=model, optimizer=opt, target="H100-80GB",
                              probe_batch_sizes=(1, 2), iterations=2)
        probe_s = time.perf_counter() - t0
        print(f"{name}: probes at batch 1 and 2 on the CPU took {probe_s:.0f} s; {len(fc.timings)} timings")
        for gpu_dir, gpu in GPUS.items():
            for path in sorted((NEUSIGHT / gpu_dir).glob(f"{name}-train-{seq}-*.json")):
                stem = path.stem
                if stem.count("-") != 3:  # multi-GPU runs (-dp4, -tp4, -pp4_1)
                    continue
                batch = int(stem.rsplit("-", 1)[1])
                measured = json.loads(path.read_text())["e2e_latency"]
                tf = json.loads(torch.ops.gpucast.forecast_step_time(fc.timings, batch, "", "", gpu=gpu))
                # Forward and backward: their kernels, or the host's time to issue them where that is longer
                # (the host's time holds no optimizer op).
                fwbw = max(tf["forward_ms"] + tf["backward_ms"], tf["host_ms"])
                rows.append(dict(model=name, gpu=gpu, batch=batch, seq=seq, measured_ms=round(measured, 2),
                                 forecast_ms=round(fwbw, 2), err_pct=round(100 * (fwbw / measured - 1), 2),
                                 optimizer_ms=round(tf["optimizer_ms"], 2), probe_s=round(probe_s, 1)))
        del model, opt, fc
    print(f"{'model':11} {'GPU':10} {'batch':>5} {'measured ms':>11} {'forecast':>9} {'error %':>8} "
          f"{'optimizer ms (not compared)':>28}")
    for r in rows:
        print(f"{r['model']:11} {r['gpu']:10} {r['batch']:5d} {r['measured_ms']:11.1f} {r['forecast_ms']:9.1f} "
              f"{r['err_pct']:8.1f} {r['optimizer_ms']:28.1f}")
    mre = sum(abs(r["err_pct"]) for r in rows) / max(1, len(rows))
    print(f"{len(rows)} measured steps: mean |error| {mre:.2f} % from CPU probes")
    print(json.dumps({"bench": "gpu_from_cpu", "mre_pct": round(mre, 3), "cases": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
