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
