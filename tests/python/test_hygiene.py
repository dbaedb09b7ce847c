"""Hygiene: repeatable records, nothing left installed, clean after exceptions."""
import json

import pytest
import torch
import torch.optim.optimizer as optimizer_module

import gpucast
from conftest import build
from examples import zoo

ops = torch.ops.gpucast


def normalized(t):
    """The trace without timestamps, addresses and thread ids (sequence numbers made relative).

    Scalar argument values are data, not structure: the optimizer's step count and bias corrections
    change from one iteration to the next, so they are left out too.
    """
    doc = json.loads(t.to_json())
    seqs = [o["seq_nr"] for o in doc["ops"] if o["seq_nr"] >= 0]
    base = min(seqs) if seqs else 0
    out_ops = []
    for o in doc["ops"]:
        o = dict(o)
        for k in ("start_ns", "end_ns", "start_seq", "end_seq", "thread", "fwd_thread"):
            o.pop(k)
        if o["seq_nr"] >= 0:
            o["seq_nr"] -= base
        for side in ("inputs", "outputs"):
            for v in o[side]:
                v.pop("storage", None)
                v.pop("value", None)
                for tm in v.get("tensors", []):
                    tm.pop("storage", None)
        out_ops.append(o)
    events = [{k: v for k, v in e.items() if k not in ("seq", "ptr", "time_ns", "thread")} for e in doc["events"]]
    allocs = [{k: v for k, v in a.items() if k != "ptr"} for a in doc["allocations"]]
    return out_ops, events, allocs, doc["counters"]


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_same_iteration_twice_gives_identical_records(name):
    model, opt, step, batch = build(zoo.CASES[name], "adamw")
    step(batch)
    step(batch)
    with gpucast.trace() as a:
        step(batch)
    with gpucast.trace() as b:
        step(batch)
    na, nb = normalized(a), normalized(b)
    assert na[0] == nb[0]
    assert na[1] == nb[1]
    assert na[3] == nb[3]
    assert [x["category"] for x in na[2]] == [x["category"] for x in nb[2]]
    assert [x["bytes"] for x in na[2] if not x["baseline"]] == [x["bytes"] for x in nb[2] if not x["baseline"]]


def no_hooks_left():
    m = torch.nn.modules.module
    return (not m._global_forward_pre_hooks and not m._global_forward_hooks
            and not optimizer_module._global_optimizer_pre_hooks
            and not optimizer_module._global_optimizer_post_hooks)


def test_no_callback_remains_after_a_trace():
    model, opt, step, batch = build(zoo.CASES["mlp"], "sgd")
    assert not ops.global_callbacks_present()
    with gpucast.trace():
        assert ops.installed_callbacks() == 1
        assert ops.global_callbacks_present()
        step(batch)
    assert ops.installed_callbacks() == 0
    assert not ops.global_callbacks_present()
    assert not ops.is_tracing()
    assert no_hooks_left()
    assert ops.cpu_allocator_hooked()  # the allocator wrapper stays, as a pass-through


class Boom(Exception):
    pass


class Exploding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, x):
        self.inner(x)
        raise Boom("inside forward")


def test_exception_inside_traced_code_leaves_gpucast_clean():
    with pytest.raises(Boom):
        with gpucast.trace():
            Exploding()(torch.randn(2, 4))
    assert not ops.is_tracing()
    assert ops.installed_callbacks() == 0
    assert not ops.global_callbacks_present()
    assert no_hooks_left()
    # Usable again, with correct module paths despite the unbalanced module stack before.
    model, opt, step, batch = build(zoo.CASES["mlp"], "sgd")
    with gpucast.trace() as t:
        step(batch)
    assert all(o.module.startswith(type(model).__name__) for o in t.ops if o.name == "aten::linear")


def test_traces_do_not_nest():
    with gpucast.trace():
        with pytest.raises(ValueError, match="a gpucast trace is already running"):
            with gpucast.trace():
                pass
    assert not ops.is_tracing()


def test_save_and_load_round_trip(tmp_path):
    model, opt, step, batch = build(zoo.CASES["gpt"], "adamw")
    with gpucast.trace() as t:
        step(batch)
    path = tmp_path / "trace.json"
    t.save(str(path))
    doc = json.loads(path.read_text())
    assert doc["schema_version"] == 3 and all(set(n) == {"code", "text"} for n in doc["notes"])
    assert doc["context"]["torch_version"] == torch.__version__.split("+")[0]
    assert doc["context"]["gpucast_version"] == gpucast.__version__
    back = gpucast.load_trace(str(path))
    assert back.to_json() == t.to_json()
    assert back.peak_bytes("cpu") == t.peak_bytes("cpu")
    assert back.summary() == t.summary()
    chrome = tmp_path / "trace.perfetto.json"
    t.save_chrome(str(chrome))
    ev = json.loads(chrome.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in ev) == len(t.ops)
    assert sum(e["ph"] == "C" for e in ev) == len(t.events)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the path without a GPU: on one, CUPTI or CUDA events time ops")
def test_without_a_gpu_ops_carry_cpu_clock_times_only():
    model, opt, step, batch = build(zoo.CASES["mlp"], "sgd")
    with gpucast.trace() as t:
        step(batch)
    doc = json.loads(t.to_json())
    assert doc["timing_source"] == "cpu_clock"
    assert all(o["device_ns"] == -1 for o in doc["ops"])
    assert all(o["end_ns"] >= o["start_ns"] for o in doc["ops"])
    assert "device timing: none (CPU clocks only)" in t.summary()
