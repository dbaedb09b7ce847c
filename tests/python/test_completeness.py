"""Completeness: gpucast records the same aten ops as torch.profiler over one iteration."""
from collections import Counter

import pytest
import torch
from torch._C._profiler import _EventType

import gpucast
from conftest import all_cases, build

CASES = all_cases()


def profiler_aten_ops(prof):
    """aten ops in torch.profiler's raw event tree (prof.events() folds an op nested in one of the same name)."""
    names = Counter()
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.TorchOp and e.name.startswith("aten::"):
            names[e.name] += 1
    return names


def gpucast_aten_ops(t):
    return Counter(o.name for o in t.ops if o.scope == "function" and o.name.startswith("aten::"))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_same_aten_ops_as_torch_profiler(name, optimizer):
    model, opt, step, batch = build(CASES[name], optimizer)
    step(batch)  # warm-up: optimizer state exists from here on
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with gpucast.trace() as t:
            step(batch)
    ours, theirs = gpucast_aten_ops(t), profiler_aten_ops(prof)
    assert sum(ours.values()) > 20
    assert ours == theirs, {"only gpucast": ours - theirs, "only torch.profiler": theirs - ours}
    assert t.counters["dropped_ops"] == 0 and t.counters["callback_errors"] == 0
