"""The meta device: meta storages traced as CPU blocks are (the meta allocator wrapper gives each a token of its
own), and forecasts from meta probes refused until the meta kernels' memory is matched to the CPU's."""
import pytest
import torch

import gpucast


def test_meta_storages_are_memory_events_with_their_bytes():
    with gpucast.trace() as t:
        x = torch.empty(1000, device="meta")  # 4000 bytes
        y = torch.empty(10, 10, dtype=torch.float16, device="meta")  # 200 bytes
        z = x.view(10, 100)  # a view: no storage of its own
        del x, z
        del y
    tr = t.result
    assert tr.peak_bytes("meta") == 4200
    assert tr.peak_bytes("cpu") == 0
    events = [(e.bytes, e.device) for e in tr.events if e.device == "meta"]
    assert events == [(4000, "meta"), (200, "meta"), (-4000, "meta"), (-200, "meta")]


def test_meta_storage_identity_is_its_token():
    """An op's output on meta names its storage as the memory event that allocated it does."""
    a = torch.empty(64, 64, device="meta")
    with gpucast.trace() as t:
        b = a @ a
    tr = t.result
    mm = [op for op in tr.ops if op.name == "aten::mm"][0]
    storage = mm.outputs[0].storage
    allocated = [e for e in tr.events if e.device == "meta" and e.bytes == 64 * 64 * 4]
    assert storage != 0 and [e.ptr for e in allocated] == [storage]
    del b


def test_meta_blocks_before_the_trace_are_its_baseline():
    w = torch.empty(256, 256, device="meta")
    with gpucast.trace() as t:
        torch.empty(4, device="meta")
    del w
    with gpucast.trace() as without:
        torch.empty(4, device="meta")
    assert t.result.baseline_bytes("meta") - without.result.baseline_bytes("meta") == 256 * 256 * 4


def test_meta_tensors_still_clone_lazily():
    """A token's DataPtr is simple: copy-on-write clones of meta tensors work as with c10's own meta allocator."""
    x = torch.empty(8, 8, device="meta")
    y = torch._lazy_clone(x)
    assert y.is_meta and y.shape == (8, 8)


def test_memory_snapshot_gives_meta_storages_a_trace_of_their_own():
    """Meta blocks are named by tokens, not addresses: in PyTorch's snapshot format they are a device of their own,
    before the CPU (which stays last), so that no segment mixes them with CPU blocks."""
    keep = torch.empty(1000, device="meta")
    with gpucast.trace() as t:
        a = torch.empty(100, device="meta")  # 400 bytes, live at the end
        b = torch.ones(50)  # 200 CPU bytes, live at the end
    snap = t.result.memory_snapshot()
    meta_trace, cpu_trace = snap["device_traces"][-2], snap["device_traces"][-1]
    assert [e["size"] for e in meta_trace if e["action"] == "alloc"][-1] == 400
    assert all(e["size"] != 400 for e in cpu_trace if e["action"] == "alloc")
    meta_index = len(snap["device_traces"]) - 2
    meta_live = [blk["size"] for s in snap["segments"] if s["device"] == meta_index for blk in s["blocks"]
                 if blk["state"] == "active_allocated"]
    expected = [al.block_bytes for al in t.result.allocations if al.device == "meta" and al.free_event < 0]
    assert sorted(meta_live) == sorted(expected) and 400 in meta_live and 4000 in meta_live
    del keep, a, b


def test_forecast_refuses_meta_probes_before_any_probe_runs():
    """Meta storages are traced, but forecasts from them are not yet the job's: refused, with what to do."""
    calls = []
    with torch.device("meta"):
        model = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match="probes on the meta device are not supported yet"):
        gpucast.forecast(lambda b: calls.append(b), lambda n: torch.zeros(n, 8), 8, model=model, target="H100-80GB")
    cpu_model = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match="build the model and batches on the CPU"):
        gpucast.forecast(lambda b: calls.append(b), lambda n: torch.zeros(n, 8, device="meta"), 8, model=cpu_model)
    assert calls == []
