"""Meta probes against CPU probes: the same job forecast for a GPU from probes on the meta device and from probes on
the CPU, each in a fresh process (the zoo, real torchvision / transformers / timm architectures, and a
transformers Llama from a local config; random weights, AdamW, probes at 2, 4 and 8). The two forecasts should be
the same number to the byte: a meta probe is the CPU probe with the memory taken out (docs/design.md, "The meta
device", lists what differs between the devices and how each is made alike). Printed per case: each forecast's
peak allocated and reserved bytes, largest batch and step time, the differences, and the seconds each took; a job
meta probes refuse is listed with the refusal. Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]

# Each case's target batch (one GPU).
DEFAULT_CASES = {"mlp": 256, "cnn": 64, "lstm": 64, "gpt": 32, "resnet18": 32, "mobilenet_v3_small": 32,
                 "bert": 32, "gpt2": 32, "vit_tiny": 32, "convnext_atto": 32, "llama": 32}


def _llama_case():
    from transformers import LlamaConfig, LlamaForCausalLM
    from examples import zoo
    cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      attn_implementation="sdpa", use_cache=False)
    return zoo.Case("llama", lambda: zoo.HFLogits(LlamaForCausalLM(cfg)), zoo._token_batch(1000, 64),
                    zoo._shifted_sequence_loss, 8)


def case(name: str):
    from examples import zoo
    if name == "llama":
        return _llama_case()
    return {**zoo.CASES, **zoo.real_cases()}[name]


def forecast_one(name: str, device: str, batch: int, target: str) -> dict:
    """One forecast in this process: the case built on `device` (its batches too)."""
    import warnings
    import torch
    import gpucast
    from examples import zoo
    c = case(name)
    torch.manual_seed(0)
    with torch.device(device):
        model = c.make_model()
    opt = zoo.make_optimizer("adamw", model.parameters())
    step = zoo.make_step(model, opt, c.loss_fn)

    def make_batch(n):
        x, y = c.make_batch(n)
        return x.to(device), y.to(device)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fc = gpucast.forecast(step, make_batch, batch, model=model, optimizer=opt, target=target)
    except ValueError as e:
        return {"refused": str(e)[:300], "seconds": time.perf_counter() - t0}
    m = fc.memory
    return {"allocated": m.peak_allocated_bytes, "reserved": m.peak_reserved_bytes, "max_batch": m.max_batch_size,
            "step_ms": fc.time.step_ms if fc.time else None, "seconds": time.perf_counter() - t0}


def run_fresh(name: str, device: str, batch: int, target: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", name, device, str(batch), target],
                         capture_output=True, text=True, timeout=1800)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(lines[-1])


def _pct(a: int, b: int) -> float:
    return 100.0 * (a - b) / b if b else 0.0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="*", default=list(DEFAULT_CASES), help="cases to run (default: all)")
    p.add_argument("--target", default="H100-80GB", help="the GPU forecast (default H100-80GB)")
    p.add_argument("--one", nargs=4, metavar=("CASE", "DEVICE", "BATCH", "TARGET"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(forecast_one(a.one[0], a.one[1], int(a.one[2]), a.one[3])))
        return 0
    rows = []
    print(f"{'case':<20}{'batch':>6}  {'CPU probes alloc / reserved':>30}  {'meta probes alloc / reserved':>30}  "
          f"{'diff alloc / reserved':>22}  {'max batch cpu / meta':>20}  {'step ms cpu / meta':>20}  {'s cpu / meta':>12}")
    for name in a.cases:
        batch = DEFAULT_CASES.get(name, 32)
        cpu = run_fresh(name, "cpu", batch, a.target)
        meta = run_fresh(name, "meta", batch, a.target)
        row = {"case": name, "batch": batch, "cpu": cpu, "meta": meta}
        if "allocated" in cpu and "allocated" in meta:
            row["alloc_diff_pct"] = _pct(meta["allocated"], cpu["allocated"])
            row["reserved_diff_pct"] = _pct(meta["reserved"], cpu["reserved"])
            row["identical"] = all(cpu[k] == meta[k] for k in ("allocated", "reserved", "max_batch", "step_ms"))
            print(f"{name:<20}{batch:>6}  {cpu['allocated']:>14} / {cpu['reserved']:>13}  "
                  f"{meta['allocated']:>14} / {meta['reserved']:>13}  "
                  f"{row['alloc_diff_pct']:>+9.3f} % / {row['reserved_diff_pct']:>+7.3f} %  "
                  f"{cpu['max_batch']:>9} / {meta['max_batch']:>8}  "
                  f"{cpu['step_ms'] or 0:>9.3f} / {meta['step_ms'] or 0:>8.3f}  "
                  f"{cpu['seconds']:>5.1f} / {meta['seconds']:>4.1f}")
        else:
            why = meta.get("refused") or meta.get("error") or cpu.get("error") or cpu.get("refused")
            print(f"{name:<20}{batch:>6}  meta probes: {why}")
        rows.append(row)
    compared = [r for r in rows if "identical" in r]
    print(json.dumps({"bench": "meta_vs_cpu", "target": a.target, "cases": rows,
                      "identical": sum(r["identical"] for r in compared), "compared": len(compared),
                      "max_abs_alloc_diff_pct": max((abs(r["alloc_diff_pct"]) for r in compared), default=0.0),
                      "max_abs_reserved_diff_pct": max((abs(r["reserved_diff_pct"]) for r in compared), default=0.0),
                      "refused": [r["case"] for r in rows if "refused" in r["meta"]]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
