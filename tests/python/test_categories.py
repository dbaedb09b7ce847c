"""Categories: parameters, gradients and optimizer state, counted to the byte."""
import pytest

import gpucast
from conftest import all_cases, build

CASES = all_cases()


def param_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(CASES))
def test_first_adamw_step(name):
    model, opt, step, batch = build(CASES[name], "adamw")
    with gpucast.trace() as t:
        step(batch)
    cats = t.bytes_by_category("cpu", at="end")
    n_params = len(list(model.parameters()))
    assert cats["parameter"] == param_bytes(model)
    assert cats["gradient"] == param_bytes(model)
    # exp_avg and exp_avg_sq per parameter, plus one float32 step tensor each.
    assert cats["optimizer_state"] == 2 * param_bytes(model) + 4 * n_params


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_sgd_momentum_state(name):
    model, opt, step, batch = build(CASES[name], "sgd")
    with gpucast.trace() as t:
        step(batch)
    cats = t.bytes_by_category("cpu", at="end")
    assert cats["parameter"] == param_bytes(model)
    assert cats["gradient"] == param_bytes(model)
    assert cats["optimizer_state"] == param_bytes(model)  # one momentum buffer per parameter


def test_activations_and_temporaries_are_found():
    model, opt, step, batch = build(CASES["gpt"], "adamw")
    step(batch)
    with gpucast.trace() as t:
        step(batch)
    allocs = t.allocations
    kinds = {a.category for a in allocs}
    assert {"activation", "temporary", "input", "parameter", "gradient", "optimizer_state"} <= kinds
    # Activations are allocated in forward and released in backward.
    ev = t.events
    for a in allocs:
        if a.category == "activation":
            assert ev[a.alloc_event].phase == "forward" and ev[a.free_event].phase == "backward"


def test_tag_tensors_skips_none_and_groups_by_device():
    """tag_tensors: one call for a list; None entries are skipped; the tagged block gets the category."""
    import torch
    with gpucast.trace() as t:
        x = torch.empty(1000)  # 4,000 bytes, allocated inside the trace
        torch.ops.gpucast.tag_tensors([None, x, x[10:]], "optimizer_state")
    blocks = [a for a in t.allocations if a.category == "optimizer_state"]
    assert [(a.bytes, a.device) for a in blocks] == [(4000, "cpu")]
    with pytest.raises(ValueError, match="unknown category .weights.; expected one of .parameter."):
        with gpucast.trace():
            torch.ops.gpucast.tag_tensors([x], "weights")


def test_scope_names_that_reuse_a_buffer_are_recorded_as_written():
    """Names of user scopes live in buffers that the next scope may reuse: each op keeps its own text."""
    import torch
    names = [f"gpucast_test_scope_{i}" for i in range(40)] + ["gpucast_test_scope_3"]
    with gpucast.trace() as t:
        for n in names:
            with torch.autograd.profiler.record_function(n):
                torch.ones(1)
    recorded = [op.name for op in t.ops if op.name.startswith("gpucast_test_scope_")]
    assert recorded == names
