"""The meta device: meta storages traced as CPU blocks are (the meta allocator wrapper gives each a token of its
own), Python meta kernels folded into the one kernel the CPU runs, and forecasts for a GPU target from meta probes
equal to those from CPU probes to the byte where that is checked."""
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


def _forecast(name: str, device: str, batch: int) -> dict:
    """The H100 forecast of a case of bench/meta_vs_cpu.py from probes on `device`, in a fresh process: CPU probes
    count every CPU block the process holds from the start (a pytest process holds other tests' tensors), meta probes
    the job's only (docs/design.md, "The meta device"), so they are compared where the process holds nothing else."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import meta_vs_cpu
    out = meta_vs_cpu.run_fresh(name, device, batch, "H100-80GB")
    assert "error" not in out and "refused" not in out, out
    return out


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_meta_probes_forecast_what_cpu_probes_forecast_to_the_byte(name):
    """The zoo's models from meta probes: the GPU forecast (memory allocated and reserved, largest batch, step time)
    is the one from CPU probes, bit for bit."""
    meta, cpu = _forecast(name, "meta", 64), _forecast(name, "cpu", 64)
    assert [meta[k] for k in ("allocated", "reserved", "max_batch", "step_ms")] == \
        [cpu[k] for k in ("allocated", "reserved", "max_batch", "step_ms")]


@pytest.mark.parametrize("name", ["mobilenet_v3_small", "convnext_atto"])
def test_real_models_from_meta_probes(name):
    """Real architectures (torchvision, timm): the memory forecast from meta probes is the CPU probes' to the byte."""
    meta, cpu = _forecast(name, "meta", 32), _forecast(name, "cpu", 32)
    assert [meta[k] for k in ("allocated", "reserved", "max_batch")] == [cpu[k] for k in ("allocated", "reserved", "max_batch")]


def test_meta_attention_runs_the_kernel_the_cpu_picks():
    """On meta, PyTorch runs attention's math path (it asks no device without a backend choice), which saves the
    sequence x sequence matrix; meta probes run the CPU's flash kernel, which saves a logsumexp."""
    from gpucast import _meta
    q = torch.empty(2, 4, 256, 32, device="meta", requires_grad=True)
    with _meta.probe_scope(), gpucast.trace() as t:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    names = {op.name for op in t.result.ops}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names
    assert "aten::_scaled_dot_product_attention_math" not in names
    sizes = sorted(e.bytes for e in t.result.events if e.device == "meta" and e.bytes > 0)
    assert sizes == [2 * 4 * 256 * 4, 2 * 4 * 256 * 32 * 4]  # logsumexp, output: no 256 x 256 matrix
    with gpucast.trace() as plain:  # outside the probes: PyTorch's own meta path
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert "aten::_scaled_dot_product_attention_math" in {op.name for op in plain.result.ops}


def test_meta_resize_allocates_through_the_meta_allocator():
    """c10's meta resize_ only sets a byte count; in meta probes it allocates, as the CPU's resize_ does."""
    from gpucast import _meta
    with _meta.probe_scope(), gpucast.trace() as t:
        x = torch.empty(0, device="meta")
        x.resize_(10, 4)
        y = torch.arange(64, device="meta")  # arange.out resizes its output
    got = [(e.bytes, t.result.ops[e.op].name) for e in t.result.events if e.device == "meta"]
    assert got == [(160, "aten::resize_"), (512, "aten::arange")]
    assert x.shape == (10, 4) and x.stride() == (4, 1)
    del x, y


def test_meta_ops_run_the_composite_the_cpu_runs():
    """aten::_safe_softmax has a Python meta kernel but the CPU and CUDA run its CompositeExplicitAutograd kernel:
    meta probes run that composite, and the trace keeps the ops inside it."""
    assert torch.ops.gpucast.meta_runs_composite("aten::_safe_softmax")
    assert not torch.ops.gpucast.meta_runs_composite("aten::addmm")  # a kernel of its own on CPU and CUDA
    assert not torch.ops.gpucast.meta_runs_composite("aten::convolution")  # picks a backend by device
    assert not torch.ops.gpucast.meta_runs_composite("gpucast::no_such_op")
    from gpucast import _meta
    x = torch.empty(4, 8, device="meta")
    with _meta.probe_scope(), gpucast.trace() as t:
        torch.ops.aten._safe_softmax(x, -1)
    ops = list(t.result.ops)
    top = [op for op in ops if op.name == "aten::_safe_softmax"][0]
    assert any(op.parent == top.id for op in ops)


def test_a_python_meta_kernel_is_traced_as_one_kernel():
    """Outside the probes too: aten::addmm on meta runs PyTorch's Python decomposition (mm, mul, add), folded into
    one op that allocates its output, as the CPU records it."""
    a, b, c = torch.empty(8, 16, device="meta"), torch.empty(16, 32, device="meta"), torch.empty(32, device="meta")
    with gpucast.trace() as t:
        out = torch.addmm(c, a, b)
    tr = t.result
    assert [(e.bytes, tr.ops[e.op].name) for e in tr.events if e.device == "meta"] == [(8 * 32 * 4, "aten::addmm")]
    assert [op.name for op in tr.ops] == ["aten::addmm"]
    assert "meta-kernels-folded" in [n["code"] for n in tr.notes]
    del out


def test_forecast_refuses_what_meta_probes_cannot_forecast_before_any_probe_runs():
    calls = []
    with torch.device("meta"):
        model = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match="probes on the meta device forecast a GPU target"):
        gpucast.forecast(lambda b: calls.append(b), lambda n: torch.zeros(n, 8, device="meta"), 8, model=model)
    with pytest.raises(ValueError, match="LSTM 'rnn' runs step by step on the meta device"):
        with torch.device("meta"):
            rnn = torch.nn.Sequential()
            rnn.add_module("rnn", torch.nn.LSTM(8, 8))
        gpucast.forecast(lambda b: calls.append(b), lambda n: torch.zeros(n, 8, device="meta"), 8, model=rnn,
                         target="H100-80GB")
    half = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).to("meta"))
    with pytest.raises(ValueError, match="some of the model's parameters or buffers are on the meta device"):
        gpucast.forecast(lambda b: calls.append(b), lambda n: torch.zeros(n, 8), 8, model=half, target="H100-80GB")
    assert calls == []


def test_meta_model_with_cpu_batches_is_refused_before_a_step_runs():
    calls = []
    with torch.device("meta"):
        model = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match="parameters are on the meta device but the batches are not"):
        gpucast.forecast(lambda b: calls.append(b), lambda n: torch.zeros(n, 8), 8, model=model, target="H100-80GB")
    assert calls == []


class _DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return y[y > 0].sum()  # a boolean mask: the output's shape depends on the values


def test_a_data_dependent_op_is_refused_naming_the_module():
    with torch.device("meta"):
        model = torch.nn.Sequential()
        model.add_module("block", _DataDependent())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        opt.zero_grad()
        model(x).backward()
        opt.step()
    with pytest.raises(ValueError, match=r"cannot run on the meta device \(in _DataDependent 'block'\)"):
        gpucast.forecast(step, lambda n: torch.zeros(n, 8, device="meta"), 8, model=model, optimizer=opt,
                         target="H100-80GB")


def test_autocast_on_meta():
    """transformers' rotary embeddings open torch.autocast(device_type="meta", enabled=False), which PyTorch refuses
    on meta ("unsupported scalarType"): in meta probes it runs; an enabled autocast is refused (it would cast
    nothing), under every name it goes by."""
    from torch import autocast as imported_before
    from gpucast import _meta
    original = torch.amp.autocast_mode.autocast.__init__
    x = torch.empty(4, 4, device="meta")
    with _meta.probe_scope():
        with torch.autocast(device_type="meta", enabled=False):
            y = x @ x
        for enabled in (lambda: torch.autocast(device_type="cuda", dtype=torch.bfloat16),
                        lambda: imported_before("cpu", dtype=torch.bfloat16),
                        lambda: torch.cpu.amp.autocast()):
            with pytest.raises(ValueError, match="does not cast meta tensors"):
                with enabled():
                    pass
        with _meta.probe_scope():  # nested: the inner end gives nothing back early
            pass
        with pytest.raises(ValueError, match="does not cast meta tensors"):
            torch.autocast("cpu")
    assert y.dtype == torch.float32
    assert torch.amp.autocast_mode.autocast.__init__ is original  # given back
    assert not torch.is_autocast_enabled("cpu")


def test_probe_scope_gives_back_what_it_registered():
    """The registrations go when the scope ends, and torch.library's record of PyTorch's own meta kernels stays."""
    from gpucast import _meta
    before = set(torch.library._impls)
    with _meta.probe_scope():
        pass
    assert set(torch.library._impls) == before
    q = torch.empty(1, 2, 16, 8, device="meta")
    with gpucast.trace() as t:
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert "aten::_scaled_dot_product_attention_math" in {op.name for op in t.result.ops}  # PyTorch's own again


def test_attention_choice_reads_what_the_cpu_reads():
    """A mask that requires grad, or a key whose batch differs from the query's, make the CPU take the math path:
    so do meta probes (the choice's key keeps both)."""
    from gpucast import _meta
    q = torch.empty(2, 4, 32, 8, device="meta", requires_grad=True)
    bias = torch.empty(2, 4, 32, 32, device="meta", requires_grad=True)
    k1 = torch.empty(1, 4, 32, 8, device="meta", requires_grad=True)
    for args, kwargs in (((q, q, q), {"attn_mask": bias}), ((q, k1, k1), {})):
        with _meta.probe_scope(), gpucast.trace() as t:
            out = torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)
        names = {op.name for op in t.result.ops}
        assert "aten::_scaled_dot_product_attention_math" in names, names
        assert "aten::_scaled_dot_product_flash_attention_for_cpu" not in names
        del out


def test_llama_from_transformers_on_meta():
    """An unmodified transformers Llama (rotary embeddings, grouped-query attention through SDPA) forecasts from
    meta probes. Not to the byte: autograd sums a residual stream's gradients out of place on meta (meta tensors
    count as subclass-like: aten/src/ATen/TensorSubclassLikeUtils.h), in place on the CPU, so meta probes hold one
    more gradient at such a sum. Above the CPU probes' peak, never below: 32,768 bytes of 207,209,472 here (the bench's
    llama case: bench/meta_vs_cpu.py)."""
    meta, cpu = _forecast("llama", "meta", 64), _forecast("llama", "cpu", 64)
    assert cpu["allocated"] <= meta["allocated"] <= cpu["allocated"] + 65536
    assert cpu["reserved"] <= meta["reserved"] <= cpu["reserved"] + 2 * 2**20  # at most one more 2 MiB segment


def _scale_case(*args: str) -> dict:
    import json
    import subprocess
    import sys
    from pathlib import Path
    bench = Path(__file__).resolve().parents[2] / "bench" / "meta_scale.py"
    out = subprocess.run([sys.executable, str(bench), "--one", *args], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("config,seq,local,dp,ckpt,params", [
    ("8B", "2048", "1", "8", "0", 8_030_261_248),
    ("70B", "4096", "1", "64", "1", 70_553_706_496),
])
def test_llama_8b_and_70b_forecast_from_meta_probes_in_bounded_memory(config, seq, local, dp, ckpt, params):
    """transformers' Llama at 8B and 70B (random init on meta, bf16, AdamW, FSDP2's rule over 8 and 64 ranks): the
    forecast completes in a process that never holds more than 4 GiB, and each rank holds at least its shard of the
    parameters, gradients and AdamW's two moments (8 bytes a parameter in bf16)."""
    r = _scale_case(config, seq, local, dp, ckpt)
    assert r["params"] == params
    assert r["max_rss_gib"] < 4.0
    assert r["allocated"] >= 8 * params // int(dp)
    assert r["reserved"] >= r["allocated"]
    assert r["step_ms"] > 0 and r["warnings"] == []
