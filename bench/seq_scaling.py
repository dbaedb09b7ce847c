"""Step time scaled by sequence length: forecast at a length, against the measured step.

gpucast.forecast(..., seq_len=L) probes three batch sizes at the shortest of its probe lengths and three lengths
at the smallest batch (forecast()'s design; by default L/4, L/2 and L) and fits every layer as
a + c·b·L + d·b·L² (tokens, and attention's pairs of tokens). Each case runs at batch 16 and lengths 128, 256
and 512, measured at each (median of 7 steps after 3, interquartile range beside it), in one process, on one
thread, and forecast three ways in the same run:
  gpucast       forecast(seq_len=L) with its default probe lengths (L/4, L/2, L: the target length is probed at
                the smallest batch)
  extrapolated  from one forecast with probes at lengths 32, 64, 128 (fc.step_time(16, seq_len=L)): beyond 128
                the lengths were not probed
  by tokens     the baseline: that forecast's step at length 128, scaled in proportion to the length

    python bench/seq_scaling.py
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]
VOCAB, PROBE_LENS, TARGETS, BATCH = 1000, (32, 64, 128), (128, 256, 512), 16


def make(n: int, length: int):
    import torch
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, VOCAB, (n, length + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def models():
    import torch
    import transformers as tf
    from examples import zoo

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(input_ids=x).logits
    yield "zoo gpt", lambda: zoo.GPT(vocab_size=VOCAB, seq_len=512)
    for attn in ("eager", "sdpa"):
        yield f"gpt2 ({attn})", lambda attn=attn: Logits(tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=VOCAB, n_positions=512, n_embd=256, n_layer=4, n_head=4, use_cache=False,
            attn_implementation=attn)))


def main() -> int:
    import torch
    import gpucast
    from examples import zoo
    torch.set_num_threads(1)

    def loss(logits, y):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    rows = []
    for name, build in models():
        torch.manual_seed(0)
        model = build()
        opt = torch.optim.AdamW(model.parameters())
        step = zoo.make_step(model, opt, loss)
        t0 = time.perf_counter()
        short = gpucast.forecast(step, make, BATCH, model=model, optimizer=opt, seq_len=PROBE_LENS[-1],
                                 probe_seq_lens=PROBE_LENS)
        probe_s = time.perf_counter() - t0
        at_probe = short.time.step_ms
        for length in TARGETS:
            t0 = time.perf_counter()
            fc = gpucast.forecast(step, make, BATCH, model=model, optimizer=opt, seq_len=length)
            fc_s = time.perf_counter() - t0
            batch = make(BATCH, length)
            for _ in range(3):
                step(batch)
            times = []
            for _ in range(7):
                t = time.perf_counter()
                step(batch)
                times.append((time.perf_counter() - t) * 1e3)
            del batch
            measured = statistics.median(times)
            q = statistics.quantiles(times, n=4)
            forecast = fc.time.step_ms
            extrapolated = short.step_time(BATCH, seq_len=length).step_ms
            linear = at_probe * length / PROBE_LENS[-1]

            def err(x):
                return round(100 * (x / measured - 1), 2)
            rows.append(dict(case=name, batch=BATCH, seq=length, measured_ms=round(measured, 3),
                             iqr_ms=round(q[2] - q[0], 3), forecast_ms=round(forecast, 3), err_pct=err(forecast),
                             probe_s=round(fc_s, 1), extrapolated_ms=round(extrapolated, 3),
                             extrapolated_err_pct=err(extrapolated), linear_ms=round(linear, 3),
                             linear_err_pct=err(linear), short_probe_s=round(probe_s, 1)))
            print(json.dumps(rows[-1]), flush=True)
        del model, opt, step, short
    print(f"{'case':14} {'length':>6} {'measured ms':>16} {'gpucast':>9} {'err %':>7} {'extrapolated':>12} "
          f"{'err %':>7} {'by tokens':>10} {'err %':>7}")
    for r in rows:
        print(f"{r['case']:14} {r['seq']:6d} {r['measured_ms']:9.1f}±{r['iqr_ms']:<6.1f} {r['forecast_ms']:9.1f} "
              f"{r['err_pct']:7.1f} {r['extrapolated_ms']:12.1f} {r['extrapolated_err_pct']:7.1f} "
              f"{r['linear_ms']:10.1f} {r['linear_err_pct']:7.1f}")

    def mean(key):
        return sum(abs(r[key]) for r in rows) / len(rows)
    print(f"{len(rows)} steps at lengths {', '.join(map(str, TARGETS))}: mean |error| {mean('err_pct'):.2f} % "
          f"(probes up to the length); extrapolated from lengths up to {PROBE_LENS[-1]}: "
          f"{mean('extrapolated_err_pct'):.2f} %; by tokens: {mean('linear_err_pct'):.2f} %")
    print(json.dumps({"bench": "seq_scaling", "mre_pct": round(mean("err_pct"), 3),
                      "extrapolated_mre_pct": round(mean("extrapolated_err_pct"), 3),
                      "by_tokens_mre_pct": round(mean("linear_err_pct"), 3), "cases": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
