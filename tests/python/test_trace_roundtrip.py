"""A saved trace loads back with exactly the values the tracer recorded (trace schema_version 3): a causal mask's
-inf fill value, integers above 2^53, complex scalars, non-ASCII user scopes and module paths.

Strings that are not UTF-8 (a user scope or module path given from C++) cannot come from Python, whose str holds
only Unicode text: tests/cpp/test_profiler.cpp (TraceValues) covers them."""
from types import SimpleNamespace

import pytest
import torch

import gpucast

BIG = 2**62 + 1  # above 2^53: a double would round it to 2^62


class Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        setattr(self, "schicht_ä", torch.nn.Linear(4, 4))  # a module path that is UTF-8, not ASCII

    def forward(self, x):
        return getattr(self, "schicht_ä")(x)


def _step(model, x, ints, c):
    scores = model(x)
    mask = torch.full((4, 4), float("-inf")).triu(1)  # a causal mask
    scores = (scores + mask).softmax(-1)
    with torch.profiler.record_function("user scope ü"):
        filled = torch.full((2,), BIG)  # an int Scalar
        shifted = ints + BIG  # a Python number given to add.Tensor: PyTorch wraps it as a 0-dim int64 tensor
        summed = torch.add(ints, ints, alpha=BIG)  # an int Scalar argument
        scaled = c * (1 + 2j)  # wrapped likewise, as a 0-dim complex tensor
        rotated = torch.add(c, c, alpha=1 - 3j)  # a complex Scalar argument
        ones = torch.full((2,), 0.5 - 0.25j)
    return scores.sum(), filled, shifted, summed, scaled, rotated, ones


def _plain(v):
    """A record's value as plain data (nested namespaces as dicts), compared exactly: ints as ints, "-inf" as text."""
    if isinstance(v, SimpleNamespace):
        return {k: _plain(x) for k, x in vars(v).items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def _scalars(ops, name):
    """The first scalar input of each op called `name` (full's fill value, add's alpha), as {"type", "value"}."""
    return [next({"type": v.type, "value": v.value} for v in op.inputs if v.kind == "scalar") for op in ops
            if op.name == name and any(v.kind == "scalar" for v in op.inputs)]


@pytest.fixture(scope="module")
def recorded():
    torch.manual_seed(0)
    model = Blocks()
    with gpucast.trace() as t:
        _step(model, torch.randn(4, 4), torch.arange(4, dtype=torch.int64), torch.ones(3, dtype=torch.complex64))
    return t.result


def _expect_the_step_s_values(ops):
    full = _scalars(ops, "aten::full")
    assert full == [{"type": "float", "value": "-inf"}, {"type": "int", "value": BIG},
                    {"type": "complex", "value": [0.5, -0.25]}]
    adds = _scalars(ops, "aten::add")
    assert {"type": "int", "value": BIG} in adds
    assert {"type": "complex", "value": [1.0, -3.0]} in adds
    # ints + BIG: add.Tensor's second input is the 0-dim int64 tensor PyTorch wrapped BIG in; its value is data,
    # not an argument, and is not recorded.
    assert any([i.shape for i in op.inputs[:2]] == [[4], []] and op.inputs[1].dtype == "int64" for op in ops
               if op.name == "aten::add" and op.inputs[0].kind == "tensor" and op.inputs[1].kind == "tensor")
    assert len([op for op in ops if op.name == "user scope ü"]) == 1
    assert any(op.module.endswith("schicht_ä") for op in ops)


def test_the_tracer_records_each_scalar_with_its_type_and_every_digit(recorded):
    _expect_the_step_s_values(recorded.ops)


def test_a_saved_trace_loads_back_with_exactly_the_recorded_values(recorded, tmp_path):
    path = tmp_path / "t.json"
    recorded.save(str(path))
    back = gpucast.load_trace(str(path))
    _expect_the_step_s_values(back.ops)
    assert len(back.ops) == len(recorded.ops)
    for a, b in zip(recorded.ops, back.ops):
        assert (a.name, a.module) == (b.name, b.module)
        assert _plain(a.inputs) == _plain(b.inputs), a.name
        assert _plain(a.outputs) == _plain(b.outputs), a.name
    assert back.notes == recorded.notes and back.context == recorded.context
    assert back.to_json() == recorded.to_json()  # the same file again, byte for byte
    assert path.read_bytes().decode("utf-8")  # UTF-8 throughout
