"""Forecasts of jobs larger than this machine, from probes on the meta device: Llama-style decoders built by
transformers from local configs (1B, 8B and 70B shapes; random init on meta, no hub, bf16 parameters), AdamW, FSDP2
over 8 to 512 H100s (the FSDP2 rule from single-process probes: each decoder layer and the root a unit), with and
without activation checkpointing (transformers' gradient checkpointing, every layer), at 2k to 8k tokens.

Each case runs in a fresh process; printed per case: the forecast's seconds and the process's peak resident memory
(the issue's bounds: <= 60 s, <= 4 GiB), each rank's peak allocated and reserved memory, whether it fits an H100's
80 GB, the largest global batch that fits, the step time priced from the GPU rates table and tokens per second per
GPU. Then a published measurement of a comparable job beside gpucast's forecast for the closest job it can express,
with the source and how the jobs differ. Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]

# Llama 3 shapes (hidden, intermediate, layers, heads, key-value heads), vocabulary 128,256.
SHAPES = {
    "1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8),
    "8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8),
    "70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8),
}
# (config, sequence length, per-rank batch, FSDP ranks, activation checkpointing)
CASES = (
    ("1B", 2048, 4, 8, False),
    ("8B", 2048, 2, 8, False),
    ("8B", 8192, 2, 8, True),
    ("8B", 8192, 1, 64, True),
    ("70B", 4096, 1, 64, True),
    ("70B", 8192, 1, 512, True),
)
TARGET = "H100-80GB"

# A published measurement of a comparable job, quoted from its source.
PUBLISHED = {
    "source": "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md",
    "quote": "Table 1 1D Parallelism (FSDP). Llama 3.1 8B model. 8 GPUs. Local batch size 2, global batch size 16. "
             "Selective activation checkpointing. | FSDP | 5,762 [TPS/GPU] | 82.4 [Memory (GiB)] |; hardware: 'Each "
             "H100 GPU is equipped with 96GB HBM2e', 500 W; sequence length 8192 "
             "(torchtitan/models/llama3/train_configs/llama3_8b.toml: seq_len = 8192)",
    "tokens_per_s_per_gpu": 5762.0,
    "memory_gib": 82.4,
    "case": ("8B", 8192, 2, 8, True),
    "differences": "torchtitan's own Llama and its mixed precision (float32 parameters and AdamW state, bf16 "
                   "compute: 16 bytes of state per parameter where gpucast's case keeps 8 in bf16), selective "
                   "activation checkpointing (some activations kept) where gpucast's case checkpoints every layer, "
                   "an H100 of 96 GB at 500 W where the forecast prices an 80 GB H100 at full power, and memory as "
                   "torchtitan's monitor reads it",
}


def _model(config: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from examples import zoo
    cfg = LlamaConfig(vocab_size=128256, max_position_embeddings=8192, attn_implementation="sdpa", use_cache=False,
                      **SHAPES[config])
    with torch.device("meta"):
        model = zoo.HFLogits(LlamaForCausalLM(cfg)).to(torch.bfloat16)
    return model


def forecast_one(config: str, seq: int, local: int, dp: int, ac: bool) -> dict:
    """One case in this process (fresh: its resident memory is the forecast's)."""
    import warnings
    import torch
    import gpucast
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from examples import zoo
    t0 = time.perf_counter()
    model = _model(config)
    if ac:
        model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters())

    def step(x):
        opt.zero_grad(set_to_none=True)
        zoo._shifted_sequence_loss(model(x), x).backward()
        opt.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fc = gpucast.forecast(step, lambda n: torch.empty(n, seq, dtype=torch.long, device="meta"), local * dp,
                              model=model, optimizer=opt, target=TARGET, probe_batch_sizes=(2, 3, 4),
                              parallel=dict(dp=dp, dp_mode="fsdp", fsdp_units=[LlamaDecoderLayer, model]))
    m = fc.memory
    step_ms = fc.time.step_ms if fc.time else None
    return {"config": config, "params": sum(p.numel() for p in model.parameters()), "seq": seq, "local_batch": local,
            "dp": dp, "checkpointing": ac, "seconds": time.perf_counter() - t0,
            "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "allocated": m.peak_allocated_bytes, "reserved": m.peak_reserved_bytes,
            "capacity": m.capacity_bytes, "fits": m.peak_reserved_bytes <= m.capacity_bytes,
            "max_global_batch": m.max_batch_size, "step_ms": step_ms,
            "tokens_per_s_per_gpu": local * seq / (step_ms / 1e3) if step_ms else None,
            "warnings": [str(w.message)[:200] for w in caught]}


def run_fresh(case: tuple) -> dict:
    config, seq, local, dp, ac = case
    out = subprocess.run([sys.executable, __file__, "--one", config, str(seq), str(local), str(dp), str(int(ac))],
                         capture_output=True, text=True, timeout=1800)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"config": config, "seq": seq, "local_batch": local, "dp": dp, "checkpointing": ac,
                "error": (out.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(lines[-1])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--one", nargs=5, help=argparse.SUPPRESS)
    p.add_argument("--only", default="", help="run the cases of this config only (1B, 8B or 70B)")
    a = p.parse_args(argv)
    if a.one:
        c, seq, local, dp, ac = a.one
        print(json.dumps(forecast_one(c, int(seq), int(local), int(dp), bool(int(ac)))))
        return 0
    gib = 2**30
    print(f"{'config':<7}{'seq':>6}{'batch/rank':>11}{'ranks':>6}{'ckpt':>6}{'seconds':>9}{'RSS GiB':>9}"
          f"{'alloc GiB':>11}{'reserved GiB':>13}{'fits':>6}{'max global batch':>17}{'step ms':>10}{'tok/s/GPU':>11}")
    rows = []
    for case in CASES:
        if a.only and case[0] != a.only:
            continue
        r = run_fresh(case)
        rows.append(r)
        if "error" in r:
            print(f"{r['config']:<7}{r['seq']:>6}{r['local_batch']:>11}{r['dp']:>6}{str(r['checkpointing']):>6}  "
                  f"error: {r['error']}")
            continue
        print(f"{r['config']:<7}{r['seq']:>6}{r['local_batch']:>11}{r['dp']:>6}{str(r['checkpointing']):>6}"
              f"{r['seconds']:>9.1f}{r['max_rss_gib']:>9.2f}{r['allocated'] / gib:>11.2f}{r['reserved'] / gib:>13.2f}"
              f"{'yes' if r['fits'] else 'no':>6}{r['max_global_batch']:>17}{r['step_ms'] or 0:>10.1f}"
              f"{r['tokens_per_s_per_gpu'] or 0:>11.0f}")
        for w in r["warnings"]:
            print(f"    warning: {w}")
    ours = next((r for r in rows if (r.get("config"), r.get("seq"), r.get("local_batch"), r.get("dp"),
                                     r.get("checkpointing")) == PUBLISHED["case"] and "error" not in r), None)
    print()
    print(f"Published: {PUBLISHED['source']}")
    print(f"  quoted: {PUBLISHED['quote']}")
    if ours is not None:
        print(f"  gpucast for the closest job it expresses ({PUBLISHED['case']}): reserved "
              f"{ours['reserved'] / gib:.1f} GiB (published {PUBLISHED['memory_gib']}), "
              f"{ours['tokens_per_s_per_gpu']:.0f} tokens/s/GPU (published {PUBLISHED['tokens_per_s_per_gpu']:.0f})")
    print(f"  how the jobs differ: {PUBLISHED['differences']}")
    done = [r for r in rows if "error" not in r]
    print(json.dumps({"bench": "meta_scale", "target": TARGET, "cases": rows,
                      "max_seconds": max((r["seconds"] for r in done), default=None),
                      "max_rss_gib": max((r["max_rss_gib"] for r in done), default=None),
                      "published": {k: v for k, v in PUBLISHED.items() if k != "case"} | {
                          "gpucast": None if ours is None else {"reserved_gib": ours["reserved"] / gib,
                                                                "tokens_per_s_per_gpu": ours["tokens_per_s_per_gpu"]}}}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
