"""Memory forecasts beyond the probes: a kernel that allocates otherwise from some batch on (found by a check probe
and handled), and routed layers (mixture of experts) sized by their experts' loads, against real runs measured in
fresh processes (profiler memory events from before the model is built). The forecasts compared to the byte run in
fresh processes too: CPU probes count what the process allocates meanwhile, and a pytest process holds other tests'
memory (535,564 bytes more in a full run)."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gpucast

# Each model's source, run here and in the measuring process alike.
MODELS = textwrap.dedent('''
    import torch, torch.nn as nn, torch.nn.functional as F
    torch.set_num_threads(1)

    def conv_job():
        """1x1, stride-1 convolutions on one thread: PyTorch's CPU convolution runs them through im2col below batch
        16 and through mkldnn from 16 on, which allocates otherwise."""
        torch.manual_seed(0)
        m = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 1), nn.ReLU(),
                          nn.Conv2d(32, 32, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
        opt = torch.optim.AdamW(m.parameters())
        def step(b):
            x, y = b
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(m(x), y).backward()
            opt.step()
        def make(n):
            g = torch.Generator().manual_seed(0)
            return torch.randn(n, 3, 16, 16, generator=g), torch.randint(10, (n,), generator=g)
        return m, opt, step, make

    class Moe(nn.Module):
        """Top-2 of 4 experts, routed by hand: token t goes to experts t % 4 and (t + 1) % 4; an expert that
        receives no token is not run (as transformers' Mixtral loops over the experts hit)."""
        def __init__(self, d=16, ffn=512):
            super().__init__()
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, ffn), nn.ReLU(), nn.Linear(ffn, d))
                                         for _ in range(4))
        def forward(self, h, tokens):
            flat = h.flatten(0, 1)
            t = tokens.flatten()
            chosen = torch.stack([t % 4, (t + 1) % 4], dim=1)
            out = torch.zeros_like(flat)
            for e in range(4):
                rows = (chosen == e).any(1).nonzero().squeeze(1)
                if rows.numel():
                    out = out.index_add(0, rows, self.experts[e](flat[rows]))
            return out.view_as(h)

    class TinyLM(nn.Module):
        def __init__(self, vocab=64, d=16):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.moe = Moe(d)
            self.head = nn.Linear(d, vocab)
        def forward(self, tokens):
            return self.head(self.moe(self.emb(tokens), tokens))

    def moe_job(routing="random"):
        """make_batch(n): n sequences of 8 tokens; random (seeded), or every expert receiving half the tokens (even),
        or every token on experts 0 and 1 (skewed)."""
        torch.manual_seed(0)
        m = TinyLM()
        opt = torch.optim.AdamW(m.parameters())
        def step(tokens):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten()).backward()
            opt.step()
        def make(n):
            if routing == "even":
                return torch.arange(n * 8).view(n, 8) % 4
            if routing == "skewed":
                return torch.zeros(n, 8, dtype=torch.long)
            return torch.randint(64, (n, 8), generator=torch.Generator().manual_seed(n))
        return m, opt, step, make
''')

MEASURE = MODELS + textwrap.dedent('''
    import sys
    from torch._C._profiler import _EventType
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        m, opt, step, make = eval(sys.argv[1])
        for _ in range(3):
            b = make(int(sys.argv[2]))
            step(b)
            del b
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
    held = peak = 0
    for _, size in sorted(events):
        held += size
        peak = max(peak, held)
    print(peak)
''')

FORECAST = MODELS + textwrap.dedent('''
    import json, sys
    import gpucast
    m, opt, step, make = eval(sys.argv[1])
    fc = gpucast.forecast(step, make, int(sys.argv[2]), model=m, optimizer=opt, target="cpu", timing_rounds=1)
    print(json.dumps({"peak": fc.memory.peak_allocated_bytes, "scaled": fc.memory.scaled, "notes": fc.memory.notes,
                      "moe": fc.memory.moe}))
''')

namespace: dict = {}
exec(MODELS, namespace)  # noqa: S102 - the test's own source
ROOT = Path(__file__).resolve().parents[2]


def fresh(script: str, job: str, batch: int) -> str:
    """The last line `script` prints, run with (job, batch) in a fresh process that imports gpucast from here."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), str(ROOT)]))
    out = subprocess.run([sys.executable, "-c", script, job, str(batch)], capture_output=True, text=True,
                         timeout=600, check=True, env=env)
    return out.stdout.strip().splitlines()[-1]


def measured(job: str, batch: int) -> int:
    """The peak of 3 iterations of `job` at `batch` in a fresh process."""
    return int(fresh(MEASURE, job, batch))


def forecast_fresh(job: str, batch: int) -> dict:
    """gpucast.forecast of `job` at `batch` (target cpu) in a fresh process: peak, scaled, notes, moe."""
    return json.loads(fresh(FORECAST, job, batch))


def codes(notes):
    return [n["code"] for n in notes]


def test_a_kernel_change_beyond_the_probes_is_found_by_a_check_probe_and_handled():
    fc = forecast_fresh("conv_job()", 32)
    notes = {n["code"]: n["text"] for n in fc["notes"]}
    # The probe at 16 runs mkldnn where those at 2, 4 and 8 ran im2col; a second at 24 gives the new allocations a
    # line, and allocates as the one at 16 does.
    assert "the memory probe at batch 16, nearer the target, allocates otherwise than the batch-8 probe" in notes[
        "kernel-change"]
    assert notes["check-probe"].startswith("a memory probe at batch 24, nearer the target, allocates as the batch-16 "
                                           "probe does")
    assert fc["scaled"]
    assert fc["peak"] == measured("conv_job()", 32)


def test_no_check_probe_where_the_target_lies_within_twice_the_largest_probe():
    m, opt, step, make = namespace["conv_job"]()
    fc = gpucast.forecast(step, make, 12, model=m, optimizer=opt, target="cpu")
    assert not [c for c in codes(fc.memory.notes) if c.startswith("check-probe") or c == "kernel-change"]


def test_a_routed_layer_is_forecast_for_even_routing_and_bounded_for_skewed():
    fc = forecast_fresh("moe_job()", 32)
    moe = fc["moe"]
    assert moe is not None and "moe-routing" in codes(fc["notes"])
    assert (moe["experts"], moe["top_k"], moe["skew"], moe["unexplained_allocations"]) == (4, 2, 1.0, 0)
    assert moe["routed_calls"] == 2  # the layer's call in each of the probes' two iterations
    # The forecast's peak is the bound; routing that gives every expert the same share peaks at the expected value,
    # and every token on the same two experts stays within the bound.
    assert fc["peak"] == moe["bound_peak_allocated_bytes"]
    assert moe["expected_peak_allocated_bytes"] == measured("moe_job('even')", 32)
    assert measured("moe_job('skewed')", 32) <= moe["bound_peak_allocated_bytes"]
    assert moe["expected_peak_allocated_bytes"] < moe["bound_peak_allocated_bytes"]


def test_moe_skew_is_checked():
    m, opt, step, make = namespace["moe_job"]()
    for bad in (0, 1.5, True, "1"):
        try:
            gpucast.forecast(step, make, 32, model=m, optimizer=opt, target="cpu", moe_skew=bad)
        except ValueError as e:
            assert str(e) == f"forecast: moe_skew must be a number in (0, 1], got {bad!r}"
        else:
            raise AssertionError(f"moe_skew={bad!r} accepted")


def test_a_check_probe_that_fails_is_left_out_and_said():
    m, opt, step, make = namespace["conv_job"]()

    def make_small(n):
        if n > 8:
            raise RuntimeError("no batch of more than 8 here")
        return make(n)
    # A GPU target: CPU probes time nothing there, so no timing probe asks for a larger batch either.
    fc = gpucast.forecast(step, make_small, 32, model=m, optimizer=opt, target="H100-80GB")
    skipped = [n["text"] for n in fc.memory.notes if n["code"] == "check-probe-skipped"]
    assert skipped == ["no memory probe nearer the target (batch 16: the step failed there (RuntimeError: no batch of "
                       "more than 8 here)): a kernel that allocates otherwise beyond the probes would not be seen"]
    assert fc.memory.scaled
