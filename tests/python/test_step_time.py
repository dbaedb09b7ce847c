"""Step-time forecast through gpucast.forecast(): fields, the timeline file, DDP buckets and bad input."""
import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch

import gpucast
from conftest import build, token_batch, token_loss
from examples import zoo


def forecast(**kw):
    case = zoo.CASES["gpt"]
    model, opt, step, _ = build(case, "adamw")
    return gpucast.forecast(step, case.make_batch, kw.pop("batch", 16), model=model, optimizer=opt, **kw)


def test_time_fields_and_timeline(tmp_path):
    fc = forecast(gnn=None)
    t = fc.time
    assert t.correction == "none: disabled (gnn=None)" and t.alpha == 1.0 and t.uncorrected_step_ms == t.step_ms
    assert t.clock == "cpu" and t.dp == 1 and t.per_rank_batch == 16
    assert t.step_ms == pytest.approx(t.forward_ms + t.backward_ms + t.optimizer_ms + t.other_ms)
    assert t.compute_ms == pytest.approx(t.step_ms) and t.exposed_comm_ms == 0 and t.buckets == []
    # Attention's backward records three more ops from batch 4 on: its layers are fitted on batch 4 and 8.
    assert [n["code"] for n in t.notes] == ["kernel-switch"]
    layers = [x["layer"] for x in t.per_layer]
    # In the order the steady iteration first runs them: the model's layers, then the loss outside modules.
    assert layers[:3] == ["GPT", "GPT.tok_emb", "GPT.pos_emb"] and layers[-1] == "(outside modules)"
    assert {"GPT.blocks.0.attn.qkv", "GPT.blocks.1.mlp.2", "GPT.head"} <= set(layers)
    assert sum(x["forward_ms"] for x in t.per_layer) == pytest.approx(t.forward_ms)
    assert all(x["forward_ms"] >= 0 and x["backward_ms"] >= 0 for x in t.per_layer)
    # Gradient bytes: every parameter's gradient, attributed to its layer (biases too, whose gradients autograd's
    # engine reduces outside their node).
    assert sum(x["grad_bytes"] for x in t.per_layer) >= 4 * sum(
        p.numel() for p in zoo.CASES["gpt"].make_model().parameters())
    assert [x["grad_bytes"] for x in t.per_layer if x["layer"] == "(outside modules)"] == [0]
    # The probes' times come from light traces; FLOPs, bytes and the layer graph from each probe's full trace.
    for x in map(json.loads, fc.timings):
        layer = {y["layer"]: y for y in x["layers"]}
        assert layer["GPT.blocks.0.attn.qkv"]["flops"] == 2 * (x["batch"] * 64) * 128 * 384
        assert layer["GPT.blocks.0.attn.qkv"]["out_bytes"] == 4 * (x["batch"] * 64) * 384
        assert x["edges"] and x["wall_ns"] > 0
    assert "step time" in str(fc)
    path = tmp_path / "step.json"
    fc.save_timeline(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 1 + 2 * len(t.per_layer) + 1
    assert spans[-1]["name"] == "optimizer step"
    assert spans[-1]["ts"] + spans[-1]["dur"] == pytest.approx(t.step_ms * 1e3)


def test_ddp_buckets_over_a_link():
    fc = forecast(batch=32, parallel=dict(dp=2), link={"alpha_us": 20.0, "bytes_per_us": 500.0}, gnn=None)
    t = fc.time
    assert t.dp == 2 and t.per_rank_batch == 16
    grads = sum(x["grad_bytes"] for x in t.per_layer)
    assert sum(b["bytes"] for b in t.buckets) == grads
    assert t.buckets[0]["bytes"] >= 2**20  # the first bucket holds at least 1 MiB (or all there is)
    for a, b in zip(t.buckets, t.buckets[1:]):
        assert b["start_ms"] >= a["end_ms"] and b["start_ms"] >= b["ready_ms"]
    ar = [2 * (2 - 1) / 2 * b["bytes"] / 500.0 / 1e3 + 2 * 20.0 / 1e3 for b in t.buckets]
    assert t.comm_ms == pytest.approx(sum(ar))
    assert t.step_ms == pytest.approx(t.compute_ms + t.exposed_comm_ms)
    no_link = forecast(batch=32, parallel=dict(dp=2), gnn=None).time
    assert [n["code"] for n in no_link.notes[1:]] == ["no-link"]


def test_a_gpu_target_without_a_link_takes_its_usual_node():
    case = zoo.CASES["mlp"]
    model, opt, step, _ = build(case, "adamw")
    fc = gpucast.forecast(step, case.make_batch, 64, model=model, optimizer=opt, target="H100-80GB",
                          parallel=dict(dp=16))
    given = fc.step_time(64, parallel=dict(dp=16), link="intra:nvlink4,gpus_per_node:8,inter:ib-ndr")
    assert fc.time.notes[0]["code"] == "default-link"
    assert fc.time.comm_ms == given.comm_ms > 0
    assert "default-link" not in [n["code"] for n in given.notes]
    assert [d["default_link"] for d in gpucast.devices() if d["name"] == "V100-32GB"] == [
        "intra:pcie3,gpus_per_node:8,inter:eth-100g"]


def test_fsdp_units_by_module_class_or_path():
    case = zoo.CASES["gpt"]
    model, opt, step, _ = build(case, "adamw")
    link = {"alpha_us": 20.0, "bytes_per_us": 500.0}
    fc = gpucast.forecast(step, case.make_batch, 16, model=model, optimizer=opt, link=link, gnn=None,
                          parallel=dict(dp=2, dp_mode="fsdp", fsdp_units={zoo.Block}))
    grads = {x["layer"]: x["grad_bytes"] for x in fc.time.per_layer}
    blocks = [f"GPT.blocks.{i}" for i in range(len(model.blocks))]
    unit = [sum(b for name, b in grads.items() if name.startswith(p + ".")) for p in blocks]
    root = sum(grads.values()) - sum(unit)
    assert all(u > 0 for u in unit) and root > 0
    # The root (embeddings, final norm, head) gathered once before forward, each block before its forward and
    # again before its backward; the blocks' gradients reduce-scattered in backward order, the root's last.
    gathers = [c["bytes"] for c in fc.time.comm if c["kind"] == "fsdp_all_gather"]
    assert gathers == [root] + unit + unit[::-1]
    assert [c["bytes"] for c in fc.time.comm if c["kind"] == "fsdp_reduce_scatter"] == unit[::-1] + [root]
    # The memory forecast follows FSDP2 over the same units (its own rule, not the coarse bound).
    assert [n["text"].startswith(f"FSDP2 (fully_shard) over 2 ranks with {len(blocks)} units and the root")
            for n in fc.memory.notes if n["code"] == "fsdp2-rule"] == [True]
    assert not [n for n in fc.memory.notes if n["code"] == "fsdp-gather-buffers"] and not fc.memory.approximate
    # The same units by class name, by path and by the modules themselves; the root's class alone: one unit.
    for units in ("Block", blocks, list(model.blocks)):
        assert fc.step_time(16, parallel=dict(dp=2, dp_mode="fsdp", fsdp_units=units), link=link,
                            gnn=None).comm == fc.time.comm
    whole = fc.step_time(16, parallel=dict(dp=2, dp_mode="fsdp", fsdp_units=[type(model)]), link=link, gnn=None)
    assert [(c["kind"], c["bytes"]) for c in whole.comm] == [("fsdp_all_gather", sum(grads.values())),
                                                             ("fsdp_reduce_scatter", sum(grads.values()))]
    with pytest.raises(ValueError, match=r"parallel: 'fsdp_units' names the class Conv2d, which no module of the "
                                         r"forecast's model is \(its classes: Block, "):
        fc.step_time(16, parallel=dict(dp=2, dp_mode="fsdp", fsdp_units=[torch.nn.Conv2d]), link=link)
    with pytest.raises(ValueError, match=r"parallel: 'fsdp_units' names 'GPT.block.0', which is neither a module "
                                         r"path of the forecast's model nor one of its classes"):
        fc.step_time(16, parallel=dict(dp=2, dp_mode="fsdp", fsdp_units="GPT.block.0"), link=link)
    with pytest.raises(ValueError, match=r"parallel: 'fsdp_units' holds a Linear that is not a module of the "
                                         r"forecast's model"):
        fc.step_time(16, parallel=dict(dp=2, dp_mode="fsdp", fsdp_units=[torch.nn.Linear(2, 2)]), link=link)


def test_ddp_broadcasts_the_models_buffers(tmp_path):
    case = zoo.CASES["cnn"]  # BatchNorm: running statistics and batch counts
    model, opt, step, _ = build(case, "adamw")
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert buffers == 1816
    link = {"alpha_us": 20.0, "bytes_per_us": 500.0}
    fc = gpucast.forecast(step, case.make_batch, 16, model=model, optimizer=opt, parallel=dict(dp=2), link=link,
                          gnn=None)
    t = fc.time
    # Before the forward, rank 0's buffers to the other rank: the bytes once over the link, one latency step.
    bc = t.comm[0]
    assert bc["kind"] == "dp_broadcast_buffers" and bc["bytes"] == buffers and bc["start_ms"] == 0
    assert bc["end_ms"] == pytest.approx((buffers / 500.0 + 20.0) / 1e3)
    assert [c["kind"] for c in t.comm[1:]] == ["dp_allreduce"] * len(t.buckets)
    assert t.step_ms == pytest.approx(t.compute_ms + t.exposed_comm_ms)
    off = fc.step_time(16, parallel=dict(dp=2, broadcast_buffers=False), link=link, gnn=None)
    assert [c["kind"] for c in off.comm] == ["dp_allreduce"] * len(off.buckets)
    assert t.step_ms - off.step_ms == pytest.approx(bc["end_ms"])
    # Given explicitly, buffer_bytes wins over the model's.
    given = fc.step_time(16, parallel=dict(dp=2, buffer_bytes=10**6), link=link, gnn=None)
    assert given.comm[0]["bytes"] == 10**6
    path = tmp_path / "ddp.json"
    fc.save_timeline(str(path))
    spans = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert spans[0]["name"] == "other (loss, zero_grad, Python)" and spans[0]["ts"] == pytest.approx(bc["end_ms"] * 1e3)


def test_other_strategies_over_a_topology(tmp_path):
    link = "intra:pcie4,gpus_per_node:2,inter:eth-100g"
    fc = forecast(batch=32, parallel=dict(dp=2, dp_mode="fsdp"), link=link, gnn=None)
    ddp = fc.step_time(32, parallel=dict(dp=2), link=link, gnn=None)
    zero = fc.step_time(32, parallel=dict(dp=2, dp_mode="zero2"), link=link, gnn=None)
    fsdp = fc.time
    assert fc.step_time(32, parallel=dict(dp=2, dp_mode="fsdp"), link=link, gnn=None) == fsdp
    tp = fc.step_time(32, parallel=dict(tp=2), link=link, gnn=None)
    pp = fc.step_time(32, parallel=dict(pp=2, micro_batches=4), link=link, gnn=None)
    across = fc.step_time(32, parallel=dict(dp=4), link=link, gnn=None)  # 4 ranks on 2-GPU nodes: the Ethernet link
    grads = sum(x["grad_bytes"] for x in ddp.per_layer)
    assert [c["kind"] for c in zero.comm][-1] == "dp_all_gather" and zero.comm[-1]["bytes"] == grads
    assert zero.optimizer_ms == pytest.approx(ddp.optimizer_ms / 2)
    gathers = [c for c in fsdp.comm if c["kind"] == "fsdp_all_gather"]
    assert sum(c["bytes"] for c in gathers) == 2 * grads  # every unit gathered in forward and in backward
    assert sum(c["bytes"] for c in fsdp.comm if c["kind"] == "fsdp_reduce_scatter") == grads
    assert tp.tp == 2 and tp.tp_comm_ms > 0 and tp.exposed_comm_ms == pytest.approx(tp.tp_comm_ms)
    assert pp.per_rank_batch == 8 and {x["stage"] for x in pp.per_layer} == {0, 1}
    # 1F1B over 2 stages and 4 micro-batches: every micro-batch's output sent forward and its gradient back.
    assert pp.bubble_ms > 0 and [c["kind"] for c in pp.comm] == ["pp_send"] * 8
    assert pp.step_ms == pytest.approx(pp.compute_ms + pp.exposed_comm_ms + pp.bubble_ms)
    assert tp.step_ms == pytest.approx(tp.compute_ms + tp.exposed_comm_ms)
    path = tmp_path / "pp.json"
    dataclasses.replace(fc, time=pp).save_timeline(str(path))
    doc = json.loads(path.read_text())["traceEvents"]
    assert [e["args"]["name"] for e in doc if e["name"] == "thread_name"] == [
        "stage 0 compute", "stage 0 communication", "stage 1 compute", "stage 1 communication"]
    spans = [e for e in doc if e["ph"] == "X"]
    # Each stage: its layers' forward and backward per micro-batch, its share of "other" after each of those 8
    # passes, the optimizer step; the sends on the senders' streams.
    layers = {s: sum(1 for x in pp.per_layer if x["stage"] == s) for s in (0, 1)}
    for s in (0, 1):
        assert sum(1 for e in spans if e["tid"] == 2 * s) == 1 + 2 * 4 + 2 * 4 * layers[s]
        assert sum(1 for e in spans if e["tid"] == 2 * s + 1) == 4
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(pp.step_ms * 1e3)
    ar = [2 * 3 / 4 * b["bytes"] / 11000.0 / 1e3 + 2 * 3 * 30.0 / 1e3 for b in across.buckets]
    assert across.comm_ms == pytest.approx(sum(ar))
    path = tmp_path / "fsdp.json"
    fc.save_timeline(str(path))
    spans = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X" and e["tid"] == 1]
    assert len(spans) == len(fc.time.comm) and spans[0]["name"].startswith("fsdp_all_gather")
    assert [x["name"] for x in gpucast.interconnects()][:2] == ["nvlink3", "nvlink4"]


def _linear_case():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    return model, opt, step, lambda n: torch.randn(n, 16)


def _rates_table(path: Path, name: str = "G1") -> Path:
    kinds = {k: {"source": "test", "forward": {"flop_eff": 0.5, "byte_eff": 0.5, "overhead_us": 10},
                 "backward": {"flop_eff": 0.25, "byte_eff": 0.5, "overhead_us": 20}}
             for k in ("matmul", "conv", "attention", "norm", "embedding", "pool", "elementwise")}
    path.write_text(json.dumps({"format": "gpucast-gpu-rates", "version": 1, "gpus": [
        {"name": name, "fp32_tflops": 10, "tf32_tflops": 20, "half_tflops": 40, "bandwidth_gbps": 1000,
         "fitted_on": "a test", "kinds": kinds}]}))
    return path


def test_gpu_target_from_cpu_probes_is_priced_from_the_rates_table(tmp_path):
    model, opt, step, make = _linear_case()
    fc = gpucast.forecast(step, make, 64, model=model, optimizer=opt, target="H100-80GB", probe_batch_sizes=(2, 4))
    tm = fc.time
    assert tm is not None and tm.step_ms > 0
    assert [l["source"] for l in tm.per_layer] == ["gpu-table"] * len(tm.per_layer)
    assert tm.notes[0]["code"] == "gpu-table-pricing"
    assert tm.correction == "none: the shipped graph network is trained on CPU steps only"
    # The shipped table's host cost per launching op (measured on an H200 machine) times the probe's launching
    # ops (the Linear, the sum, their backward, the loss's seed: not the optimizer's): where that is longer than
    # the kernels, the rest of the step is the difference.
    us_per_op = json.loads((Path(__file__).resolve().parents[2] / "predictor" / "weights" /
                            "gpu_rates.json").read_text())["host"]["us_per_op"]
    largest = max(map(json.loads, fc.timings), key=lambda t: t["batch"])
    # aten::linear, aten::sum; backward: the seed's aten::ones_like, aten::mm (the weight's gradient), aten::sum
    # (the bias's); SGD's own ops are the optimizer's.
    assert [json.loads(t)["launch_ops"] for t in fc.timings] == [5, 5]
    host_ms = us_per_op * largest["launch_ops"] / 1e3
    kernels_ms = tm.forward_ms + tm.backward_ms + tm.optimizer_ms
    assert host_ms > kernels_ms
    assert tm.host_ms == pytest.approx(host_ms, rel=1e-9)
    assert tm.other_ms == pytest.approx(host_ms - kernels_ms, rel=1e-9)
    assert tm.step_ms == pytest.approx(host_ms, rel=1e-9)
    assert "host-bound" in [n["code"] for n in tm.notes]
    # The same probes against a hand-made table: the Linear's forward at batch 64 is one aten::linear of
    # 2 * 64 * 16 * 32 FLOPs (at 0.5 x 10 TFLOP/s) moving input, weight, bias and output (at 0.5 TB/s), one kernel.
    table = _rates_table(tmp_path / "rates.json")
    got = json.loads(torch.ops.gpucast.forecast_step_time(fc.timings, 64, "", "", gpu="g1", gpu_rates=str(table)))
    layer = next(l for l in got["per_layer"] if l["layer"] == "Sequential.0")
    compute = 2 * 64 * 16 * 32 / 5e12
    memory = 4 * (64 * 16 + 32 * 16 + 32 + 64 * 32) / 5e11
    assert layer["forward_ms"] == pytest.approx((max(compute, memory) + 10e-6) * 1e3, rel=1e-9)
    assert got["other_ms"] == 0 and got["host_ms"] == -1  # a table without a host cost: the kernels alone
    assert fc.step_time(128).step_ms > 0  # other batch sizes from the same probes, priced the same way


def test_gpu_target_without_rates_has_no_step_time(tmp_path, monkeypatch):
    model, opt, step, make = _linear_case()
    with pytest.warns(UserWarning, match="no step time for RTX-4090: \\[gpucast:gpu-rates\\] forecast_step_time: the "
                                         "GPU rates table '.*' "
                                         "has no 'RTX-4090'; it has: H100-80GB, H200-141GB"):
        fc = gpucast.forecast(step, make, 64, model=model, optimizer=opt, target="RTX-4090", probe_batch_sizes=(2, 4))
    assert fc.time is None
    with pytest.raises(ValueError, match="save_timeline: this forecast has no step time"):
        fc.save_timeline(str(tmp_path / "x.json"))
    bad = tmp_path / "truncated.json"
    bad.write_text(_rates_table(tmp_path / "full.json").read_text()[:100])
    monkeypatch.setenv("GPUCAST_GPU_RATES", str(bad))
    # A table of the user's that cannot be used: the shipped one prices the step, and a warning says so.
    with pytest.warns(UserWarning, match=f"GPUCAST_GPU_RATES could not be used for H100-80GB "
                                         f"\\(\\[gpucast:gpu-rates\\] {bad}: malformed JSON at byte "):
        fc = gpucast.forecast(step, make, 64, model=model, optimizer=opt, target="H100-80GB", probe_batch_sizes=(2, 4))
    assert fc.time is not None and fc.memory is not None
    # Valid JSON with a field of the wrong type is as unusable (it raised before its error had a code).
    wrong = tmp_path / "wrong_type.json"
    doc = json.loads(_rates_table(tmp_path / "full.json").read_text())
    doc["gpus"][0]["fp32_tflops"] = "fast"
    wrong.write_text(json.dumps(doc))
    monkeypatch.setenv("GPUCAST_GPU_RATES", str(wrong))
    with pytest.warns(UserWarning, match=f"GPUCAST_GPU_RATES could not be used for H100-80GB "
                                         f"\\(\\[gpucast:gpu-rates\\] {wrong}: gpus\\[0\\]"):
        typed = gpucast.forecast(step, make, 64, model=model, optimizer=opt, target="H100-80GB",
                                 probe_batch_sizes=(2, 4))
    assert typed.time is not None
    monkeypatch.delenv("GPUCAST_GPU_RATES")
    shipped = gpucast.forecast(step, make, 64, model=model, optimizer=opt, target="H100-80GB", probe_batch_sizes=(2, 4))
    assert [x["forward_ms"] for x in fc.time.per_layer] == [x["forward_ms"] for x in shipped.time.per_layer]
    # Neither the user's table nor the shipped one knows the GPU: no step time, the memory forecast stands.
    monkeypatch.setenv("GPUCAST_GPU_RATES", str(bad))
    with pytest.warns(UserWarning, match=f"no step time for RTX-4090: \\[gpucast:gpu-rates\\] {bad}: malformed JSON at byte "):
        fc = gpucast.forecast(step, make, 64, model=model, optimizer=opt, target="RTX-4090", probe_batch_sizes=(2, 4))
    assert fc.time is None and fc.memory is not None


def test_gpu_rates_table():
    names = [g["name"] for g in gpucast.gpu_rates()]
    assert names == ["H100-80GB", "H200-141GB", "A100-80GB", "A100-40GB", "L4", "V100-32GB"]
    h100 = gpucast.gpu_rates()[0]
    assert h100["fitted_on"].startswith("NeuSight per-operator latencies on NVIDIA_H100_80GB_HBM3")
    assert set(h100["kinds"]) == {"matmul", "conv", "attention", "norm", "embedding", "pool", "elementwise"}
    with pytest.raises((ValueError, RuntimeError), match="GPU rates table '/nonexistent.json' cannot be read"):
        gpucast.gpu_rates("/nonexistent.json")


@pytest.mark.parametrize("kw,message", [
    (dict(link={"alpha": 1}), "forecast: link should hold alpha_us and bytes_per_us (what gpucast.calibrate() "
                              "returns) or topology keys (intra, alpha_us, bytes_per_us, gpus_per_node, inter, "
                              "inter_alpha_us, inter_bytes_per_us, samples, ranks, samples_gap_us, "
                              "late_samples, late_gap_us, overlap, memory_contention, "
                              "memory_contention_samples, compute_contention, balance, sync_wait_us, "
                              "drift_compute, drift_memory, ddp_overhead_us, ddp_overhead_samples, "
                              "fsdp_overhead_unit_us, fsdp_overhead_layer_us, fsdp_overhead_mib_us, send_samples, "
                              "all_gather_samples, reduce_scatter_samples, algorithm), got {'alpha': 1}"),
    (dict(link="intra:nvlink9"), "[gpucast:link] link: unknown interconnect 'nvlink9'; known: nvlink3, nvlink4, nvlink5, pcie3, pcie4, "
                                 "pcie5, ib-hdr, ib-ndr, eth-100g"),
])
def test_bad_step_time_input(kw, message):
    with pytest.raises(ValueError) as e:
        forecast(batch=32, **kw)
    assert str(e.value).splitlines()[0] == message


def test_a_misspelt_link_key_is_named():
    # Known keys beside it do not hide it (it would have silently left every rank in one node).
    with pytest.raises(ValueError) as e:
        forecast(batch=32, target="H100-80GB", parallel=dict(dp=16),
                 link={"intra": "nvlink4", "gpus_per_nodes": 8, "inter": "ib-ndr"})
    assert str(e.value) == (
        "forecast: link: unknown key 'gpus_per_nodes'; known: intra, alpha_us, bytes_per_us, gpus_per_node, inter, "
        "inter_alpha_us, inter_bytes_per_us, samples, ranks, samples_gap_us, late_samples, late_gap_us, overlap, "
        "memory_contention, memory_contention_samples, compute_contention, balance, sync_wait_us, drift_compute, "
        "drift_memory, ddp_overhead_us, ddp_overhead_samples, fsdp_overhead_unit_us, fsdp_overhead_layer_us, "
        "fsdp_overhead_mib_us, send_samples, all_gather_samples, reduce_scatter_samples, algorithm (and what "
        "gpucast.calibrate() "
        "also returns: backend, cores, local_ranks, threads)")


def test_a_batch_below_the_ranks_is_refused_before_the_probes():
    case = zoo.CASES["mlp"]
    model, opt, step, _ = build(case, "sgd")
    calls = []

    def counted(batch):
        calls.append(1)
        return step(batch)
    with pytest.raises(ValueError) as e:
        gpucast.forecast(counted, case.make_batch, 4, model=model, optimizer=opt, parallel=dict(dp=2, micro_batches=4))
    assert str(e.value) == ("forecast: batch_size 4 is smaller than dp x micro_batches = 8: every rank needs a sample "
                            "in every micro-batch")
    assert calls == []


def test_collectives_without_a_link_are_warned_of():
    # On the CPU target there is no usual node: the forecast leaves the all-reduces out, and says so aloud.
    with pytest.warns(UserWarning, match=r"gpucast.forecast: no link is known for target 'cpu', so the step's "
                                         r"collectives \(dp=2, tp=1, pp=1\) are left out of it; pass "
                                         r"link=gpucast.calibrate\(\)"):
        fc = forecast(batch=32, parallel=dict(dp=2), gnn=None)
    assert fc.time.exposed_comm_ms == 0 and fc.time.comm == []


def test_link_sample_lists_name_their_key():
    from gpucast._settings import _format_link
    assert _format_link({"alpha_us": 1, "bytes_per_us": 2, "memory_contention_samples": [
        {"bytes": 2097152, "factor": 1.0}, {"bytes": 33554432, "factor": 1.36}]}) == (
        "alpha_us:1,bytes_per_us:2,memory_contention_samples:2097152/1;33554432/1.3600000000000001")
    late = {"samples": [{"bytes": 1, "us": 3}], "samples_gap_us": 5, "late_gap_us": 9}
    assert _format_link({"alpha_us": 1, "bytes_per_us": 2, "ranks": 2, "late_samples": [{"bytes": 1, "us": 4}],
                         **late}) == ("alpha_us:1,bytes_per_us:2,samples:1/3,ranks:2,samples_gap_us:5,"
                                      "late_samples:1/4,late_gap_us:9")
    # Without the samples they refine, the rank count and the late samples are left out.
    assert _format_link({"alpha_us": 1, "bytes_per_us": 2, "ranks": 2, "samples_gap_us": 5,
                         "late_samples": [{"bytes": 1, "us": 4}], "late_gap_us": 9}) == "alpha_us:1,bytes_per_us:2"
    for key, second in (("samples", "us"), ("late_samples", "us"), ("memory_contention_samples", "factor")):
        with pytest.raises(ValueError) as e:
            _format_link({"alpha_us": 1, "bytes_per_us": 2, "ranks": 2, **late, key: [{"bytes": 1}]})
        assert str(e.value) == (f"link: '{key}' should be a list of {{'bytes': ..., '{second}': ...}} as "
                                "gpucast.calibrate() returns, got [{'bytes': 1}]")


def test_more_stages_than_layers():
    layers = len(forecast(batch=32).time.per_layer)
    with pytest.raises(ValueError) as e:
        forecast(batch=128, parallel=dict(pp=128))
    assert str(e.value).splitlines()[0] == (f"[gpucast:step-time] parallel: 'pp' 128 is more than the {layers} "
                                            "layers the probes found: every stage needs a layer")


def test_graph_network_corrects_the_cpu_step():
    fc = forecast(batch=32)
    t = fc.time
    assert t.correction == "gnn", t.correction
    assert t.alpha != 1.0 and 0.2 < t.alpha < 4.5
    # The same probes without the network, and with a weights file that is not there: alpha = beta = 1.
    raw = fc.step_time(32, gnn=None)
    assert raw.step_ms == pytest.approx(t.uncorrected_step_ms)
    assert t.step_ms == pytest.approx(raw.step_ms + (t.alpha - 1) * raw.compute_ms
                                      + (t.beta - 1) * raw.exposed_comm_ms)
    assert t.compute_ms == pytest.approx(t.alpha * raw.compute_ms)
    missing = fc.step_time(32, gnn="/nonexistent/step_gnn.gcw")
    assert missing.step_ms == pytest.approx(t.uncorrected_step_ms)
    assert missing.correction.startswith("none: ") and "/nonexistent/step_gnn.gcw" in missing.correction
    assert missing.notes[-1]["code"] == "gnn-not-applied"


def test_sparse_timing_reports_what_was_measured():
    fc = forecast(batch=32, time_fraction=0.25, gnn=None)
    t = fc.time
    n = len(t.per_layer)
    measured = [x for x in t.per_layer if x["source"] == "measured"]
    assert t.timed_layers == len(measured) == -(-n // 4)  # a quarter of the layers, rounded up
    assert {x["source"] for x in t.per_layer} - {"measured"} <= {"kind", "pooled", "scaled_prior", "prior"}
    assert [x["code"] for x in t.notes[:3]] == ["reach-probe", "kernel-switch", "sparse-timing"]
    # Chosen once, on the first probe: every timing trace was asked for the same layers, the measured ones.
    chosen = [[y["layer"] for y in x["layers"] if y["timed"]] for x in map(json.loads, fc.timings)]
    assert len(chosen) == 4 and chosen[0] == chosen[1] == chosen[2] == chosen[3]
    assert set(chosen[0]) == {x["layer"] for x in measured}
    # Other batch sizes from the same probes keep that choice; a fraction asks for all layers again (CPU clocks
    # timed every op), chosen anew by the design.
    assert fc.step_time(32, gnn=None) == dataclasses.replace(t, notes=t.notes[1:])  # forecast() adds the probe's
    again = fc.step_time(32, time_fraction=1.0, gnn=None)
    assert again.timed_layers == -1 and all(x["source"] == "measured" for x in again.per_layer)  # -1: all
    half = fc.step_time(32, time_fraction=0.5, gnn=None)
    assert half.notes[1]["code"] == "sparse-timing" and half.timed_layers == -(-n // 2)


def test_a_time_budget_bounds_the_timed_layers():
    fc = forecast(batch=32, time_budget=0.3, gnn=None)
    n = len(fc.time.per_layer)
    assert 1 <= fc.time.timed_layers < n
    assert fc.time.notes[2]["code"] == "sparse-timing"
    for bad in ({"time_budget": 0}, {"time_fraction": 1.5}, {"time_budget": "half"}):
        (name, value), = bad.items()
        with pytest.raises(ValueError, match=rf"forecast: {name} must be a number in \(0, 1\], got {value!r}"):
            forecast(**bad)


def test_trace_records_the_layers_it_was_asked_to_time():
    case = zoo.CASES["mlp"]
    model, opt, step, _ = build(case, "sgd")
    batch = case.make_batch(4)
    with gpucast.trace(timed_layers=["MLP.net.0", "(outside modules)"]) as t:
        step(batch)
    doc = json.loads(t.result.to_json())
    assert doc["timed_layers"] == ["MLP.net.0", "(outside modules)"]
    assert ("device timing: none (CPU clocks only); sparse: 2 chosen layer(s) timed, the rest predicted"
            in t.result.summary())
    timing = json.loads(t.result.handle.iteration_timing(4))
    assert {x["layer"]: x["timed"] for x in timing["layers"]} == {
        "MLP.net.0": True, "MLP.net.1": False, "MLP.net.2": False, "MLP.net.3": False, "MLP.net.4": False,
        "(outside modules)": True}
    with gpucast.trace() as t:  # no choice: every layer timed, nothing recorded about it
        step(batch)
    assert "timed_layers" not in json.loads(t.result.to_json())
    assert all(x["timed"] for x in json.loads(t.result.handle.iteration_timing(4))["layers"])
    for bad in ("MLP.net.0", [1, 2]):
        with pytest.raises(ValueError, match=r"gpucast.trace: timed_layers should be a list of layer names \(str\), "
                                             r"got "):
            gpucast.trace(timed_layers=bad)


def test_device_timers_cover_the_chosen_layers_only():
    # The tracer's device-timing path, with a CPU-clock stand-in for CUPTI / CUDA events: which ops get timers.
    case = zoo.CASES["mlp"]
    model, opt, step, _ = build(case, "adamw")
    batch = case.make_batch(4)
    step(batch)  # the optimizer's state exists: the traced step is a steady one
    torch.ops.gpucast._use_stand_in_device_timer(True)
    try:
        with gpucast.trace(timed_layers=["MLP.net.2"]) as sparse:
            step(batch)
        with gpucast.trace() as full:
            step(batch)
    finally:
        torch.ops.gpucast._use_stand_in_device_timer(False)
    doc = json.loads(sparse.result.to_json())
    assert doc["timing_source"] == "cpu_spans" and doc["timed_layers"] == ["MLP.net.2"]
    ops = doc["ops"]

    def layer(o):  # the op's own module, or (backward) its forward op's, or its enclosing op's; the engine's work
        while True:  # outside a node, in the engine's record around that node (a bias's gradient summed): the node's
            if o["phase"] == "forward" and o["module"]:
                return o["module"]
            if o["fwd_op"] >= 0:
                return ops[o["fwd_op"]]["module"] or "(outside modules)"
            if o["parent"] < 0:
                return "(outside modules)"
            parent = ops[o["parent"]]
            if parent["name"].startswith("autograd::engine::evaluate_function") and o["scope"] == "function":
                node = [x for x in ops if x["parent"] == parent["id"] and x["scope"] == "backward_function"]
                if node:
                    o = node[0]
                    continue
            o = parent

    timed = [o for o in ops if o["device_ns"] >= 0]
    untimed = [o for o in ops if o["device_ns"] < 0]
    # Every optimizer op, and the forward and backward ops of MLP.net.2 (nested ones too), nothing else.
    assert {o["name"] for o in timed if o["phase"] == "optimizer"} >= {"Optimizer.step#AdamW.step"}
    assert all(o["phase"] == "optimizer" or layer(o) == "MLP.net.2" for o in timed)
    assert not any(o["phase"] == "optimizer" for o in untimed)
    mine = [o for o in ops if o["phase"] != "optimizer" and layer(o) == "MLP.net.2"
            and (o["scope"] == "backward_function" or o["phase"] == "forward")]
    assert {o["name"] for o in mine} >= {"aten::linear", "aten::addmm", "AddmmBackward0"}
    # The engine's reduction of the layer's bias gradient, after its node: timed with it.
    assert any(o["name"] == "aten::sum" and o["phase"] == "backward" and o["device_ns"] >= 0 and
               layer(o) == "MLP.net.2" for o in timed)
    assert any(o["name"] == "aten::sum" and o["phase"] == "backward" and layer(o) == "MLP.net.0" for o in untimed)
    assert all(o["device_ns"] >= 0 for o in mine)
    assert any(layer(o) == "MLP.net.0" for o in untimed) and any(layer(o) == "MLP.net.4" for o in untimed)
    # Without a choice, every op carries a device time.
    assert all(o["device_ns"] >= 0 for o in json.loads(full.result.to_json())["ops"] if o["complete"])
    # The forecast over device-clock probes timed sparsely: the chosen layers' times, and no re-choice later.
    torch.ops.gpucast._use_stand_in_device_timer(True)
    try:
        fc = gpucast.forecast(step, case.make_batch, 16, model=model, optimizer=opt, time_fraction=0.25, gnn=None)
    finally:
        torch.ops.gpucast._use_stand_in_device_timer(False)
    assert fc.time.clock == "device" and fc.time.timed_layers == 2  # of 6
    with pytest.raises(ValueError, match=r"step time: every_layer asks for the times of every layer, but the probes "
                                         r"were timed on the device for 2 of their 6 layers only"):
        fc.step_time(16, time_fraction=1.0)


def test_timing_probes_where_the_cpu_convolution_kernel_changes():
    # One thread: PyTorch runs the 1x1 convolutions through im2col below batch 16, through mkldnn from 16 on.
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 1), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 1),
                                    torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = zoo.make_step(model, opt, torch.nn.functional.cross_entropy)

        def make_batch(n):
            return torch.randn(n, 3, 4, 4), torch.zeros(n, dtype=torch.long)

        def probed(batch, **kw):
            fc = gpucast.forecast(step, make_batch, batch, model=model, optimizer=opt, gnn=None, **kw)
            return fc, [json.loads(x)["batch"] for x in fc.timings]

        fc, batches = probed(32)
        assert batches == [2, 4, 8, 16, 24]
        assert [json.loads(x)["im2col_conv_ops"] for x in fc.timings] == [2, 2, 2, 0, 0]
        assert [n["code"] for n in fc.time.notes[:2]] == ["im2col-probes", "kernel-switch"]
        assert fc.probe_batch_sizes == (2, 4, 8)  # the memory forecast keeps the traced probes
        assert probed(20)[1] == [2, 4, 8, 16]
        assert probed(40, parallel=dict(dp=4))[1] == [2, 4, 8]  # 10 samples per rank: the probes' kernels
        # A probe already runs the target's kernels: no timing probe. The memory forecast matches the probes'
        # allocations op by op (the same top-level ops, other kernels inside the convolutions) and names the cause.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fc, batches = probed(32, probe_batch_sizes=(4, 16))
        assert batches == [4, 16]
        assert fc.memory.scaled
        note = [n["text"] for n in fc.memory.notes if n["code"] == "kernels-differ"]
        assert len(note) == 1 and ("PyTorch's CPU convolution leaves im2col at batch 16 for 1x1 stride-1 kernels "
                                   "on one thread") in note[0], fc.memory.notes  # the cause named: no field
    finally:
        torch.set_num_threads(threads)


def test_a_timing_probe_nearer_a_far_target():
    case = zoo.CASES["mlp"]
    model, opt, step, _ = build(case, "sgd")

    def probed(batch):
        fc = gpucast.forecast(step, case.make_batch, batch, model=model, optimizer=opt, gnn=None)
        return fc, [json.loads(x)["batch"] for x in fc.timings]

    fc, batches = probed(256)  # 32 times the largest probe: half the target is timed too
    assert batches == [2, 4, 8, 128]
    assert fc.time.notes[0]["code"] == "reach-probe"
    assert fc.probe_batch_sizes == (2, 4, 8)
    assert probed(25)[1] == [2, 4, 8, 12]  # just over 3 times
    assert probed(24)[1] == [2, 4, 8]  # 3 times: the probes alone
    per_rank_24 = gpucast.forecast(step, case.make_batch, 192, model=model, optimizer=opt, gnn=None,
                                   parallel=dict(dp=8))
    assert len(per_rank_24.timings) == 3  # 24 per rank: 3 times the largest probe


def test_median_timing_over_light_traces():
    def run(wall, fw):
        return json.dumps({"batch": 4, "wall_ns": wall, "optimizer_ns": 5.0, "other_ns": 1.0, "clock": "cpu",
                           "layers": [{"layer": "Net.fc", "forward_ns": fw, "backward_ns": 2.0, "grad_bytes": 0,
                                       "backward_order": 0}]})
    m = json.loads(torch.ops.gpucast.median_timing([run(10.0, 3.0), run(900.0, 700.0), run(12.0, 4.0)]))
    assert (m["wall_ns"], m["layers"][0]["forward_ns"], m["layers"][0]["backward_ns"]) == (12.0, 4.0, 2.0)
    with pytest.raises(ValueError) as e:
        torch.ops.gpucast.median_timing([run(1.0, 1.0), "{}"])
    assert str(e.value) == "[gpucast:timing] median_timing: run 1: iteration timing: missing field 'batch'"


def test_steady_timing_takes_the_median_of_its_light_traces(monkeypatch):
    # A probe step of about 0.1 s / 9 or less gets the most light traces; each is an iteration of its own.
    from gpucast import _probes
    case = zoo.CASES["mlp"]
    torch.manual_seed(0)
    model = case.make_model()
    opt = zoo.make_optimizer("sgd", model.parameters())
    step = zoo.make_step(model, opt, case.loss_fn)
    batch = case.make_batch(2)
    with gpucast.trace() as t:
        step(batch)
    structure = t.result.handle.iteration_timing(2)
    seen = []
    real = torch.ops.gpucast.median_timing
    monkeypatch.setattr(_probes.torch.ops.gpucast, "median_timing", lambda runs: seen.append(len(runs)) or real(runs),
                        raising=False)
    _probes._steady_timing(step, batch, 2, structure, budget_s=1e-9)
    _probes._steady_timing(step, batch, 2, structure, budget_s=1e3)
    assert seen == [3, 9]


def test_timing_with_structure_names_the_bad_argument():
    good = json.dumps({"batch": 1, "wall_ns": 1.0, "optimizer_ns": 0.0, "other_ns": 0.0, "clock": "cpu",
                       "layers": []})
    with pytest.raises(ValueError) as e:
        torch.ops.gpucast.timing_with_structure(good, "nope")
    assert str(e.value).startswith("[gpucast:timing] timing_with_structure: structure: iteration timing: malformed JSON "
                                   "at byte 2: ")
    with pytest.raises(ValueError) as e:
        torch.ops.gpucast.timing_with_structure("{}", good)
    assert str(e.value) == "[gpucast:timing] timing_with_structure: timing: iteration timing: missing field 'batch'"


@pytest.mark.parametrize("change,message", [
    (lambda d: d.update(batch=0), "field 'batch' should be an integer from 1 to 2^40, got 0"),
    (lambda d: d.update(wall_ns="fast"), "field 'wall_ns' should be a finite number, got \"fast\""),
    (lambda d: d.update(clock="sundial"), "field 'clock' should be one of cpu|device|gpu-table, got \"sundial\""),
    (lambda d: d["layers"][0].update(grad_bytes=1.5), "field 'layers[0].grad_bytes' should be an integer in range, "
                                                      "got 1.5"),
    (lambda d: d["layers"][0].update(parts=[["matmul", False, 1.0]]),
     "field 'layers[0].parts[0]' should be [kind, half, flops, bytes, kernels], got [\"matmul\",false,1.0]"),
    (lambda d: d.update(edges=[[0, 7, 10]]), "edge 0 -> 7 names a layer that is not there (1 layers)"),
    (lambda d: d.update(ops_total=2**63 - 1), "field 'ops_total' should be an integer from 0 to 2^40, "
                                              "got 9223372036854775807"),
])
def test_a_bad_iteration_timing_names_the_field(change, message):
    # Timings cross the boundary as JSON text: every field is checked and named, never a raw library message.
    doc = {"batch": 4, "wall_ns": 10.0, "optimizer_ns": 5.0, "other_ns": 1.0, "clock": "cpu",
           "layers": [{"layer": "Net.fc", "forward_ns": 3.0, "backward_ns": 2.0, "grad_bytes": 0, "backward_order": 0}]}
    json.loads(torch.ops.gpucast.median_timing([json.dumps(doc)]))  # the document as it stands is good
    change(doc)
    with pytest.raises(ValueError) as e:
        torch.ops.gpucast.median_timing([json.dumps(doc)])
    assert str(e.value) == f"[gpucast:timing] median_timing: run 0: iteration timing: {message}"


def test_the_shipped_network_corrects_only_the_batch_sizes_it_was_trained_near():
    import gzip
    from conftest import read_weights_header
    dataset = Path(__file__).resolve().parents[2] / "bench" / "dataset"
    # The weights' header holds the training graphs' batch sizes (the trainer writes them), which are the recordings'.
    header = read_weights_header(Path(torch.ops.gpucast.step_gnn_weights_path()))
    for name in ("step_times_3.jsonl.gz", "step_times_4.jsonl.gz"):  # the shipped network's training data
        with gzip.open(dataset / name, "rt") as f:
            assert sorted({json.loads(line)["batch"] for line in f}) == header["applicability"]["batches"] == [16, 32]
    assert forecast(batch=16).time.correction == "gnn"
    assert forecast(batch=128).time.correction == ("none: the graph network is trained on batch sizes 16, 32; a "
                                                   "rank's batch of 128 is outside 8-64")


def test_the_batch_range_comes_from_the_weights_header(tmp_path):
    # The range is the weights file's (its training graphs' batches, a factor kStepGnnBatchReach = 2 around them),
    # whichever file it is: C++ decides it, once (gpucast/step_gnn.h: correct_step_time).
    from conftest import read_weights_header, rewrite_weights_header
    shipped = Path(torch.ops.gpucast.step_gnn_weights_path())
    reach = read_weights_header(shipped)["applicability"]
    fc = forecast(batch=16, gnn=None)
    for batches, expected in (([64], "none: the graph network is trained on batch sizes 64; a rank's batch of 16 is "
                                     "outside 32-128"),
                              ([4, 8], "gnn")):  # 2-16: 16 is inside
        other = tmp_path / f"batches_{batches[0]}.gcw"
        rewrite_weights_header(shipped, other, applicability={**reach, "batches": batches})
        assert fc.step_time(16, gnn=str(other)).correction == expected
    unlimited = tmp_path / "no_batches.gcw"  # a file without them (trained before they were written): no range
    rewrite_weights_header(shipped, unlimited, applicability={k: v for k, v in reach.items() if k != "batches"})
    assert fc.step_time(16, gnn=str(unlimited)).correction == "gnn"
    assert fc.step_time(128, gnn="").correction.startswith("none: the graph network is trained on batch sizes 16, 32")
    # The corrected step keeps what alpha and beta do not scale: step = uncorrected + (alpha - 1) compute.
    t = fc.step_time(16, gnn="")
    assert t.correction == "gnn"
    assert t.step_ms == pytest.approx(t.uncorrected_step_ms + (t.alpha - 1.0) * (t.compute_ms / t.alpha), rel=1e-12)


def test_step_time_scales_by_sequence_length():
    make = token_batch
    torch.manual_seed(0)
    model = zoo.GPT(seq_len=128)
    opt = torch.optim.AdamW(model.parameters())
    step = zoo.make_step(model, opt, token_loss)
    fc = gpucast.forecast(step, make, 16, model=model, optimizer=opt, seq_len=96, probe_seq_lens=(16, 32, 48))
    assert fc.seq_len == 96 and fc.time is not None
    assert sorted({json.loads(t)["seq"] for t in fc.timings}) == [16, 32, 48]
    assert fc.time.correction == "none: the graph network is trained on steps at their probes' sequence length"
    longer = fc.step_time(16, seq_len=192)
    assert longer.step_ms > fc.time.step_ms  # the same probes, twice the length
    # Priced for a GPU from the same kind of CPU probes: every length from the probes' work.
    gpu = gpucast.forecast(step, make, 16, model=model, optimizer=opt, seq_len=96, probe_seq_lens=(16, 32, 48),
                           target="H100-80GB")
    assert gpu.time is not None
    at_192 = gpu.step_time(16, seq_len=192)
    # The kernels grow with the length; this small decoder's step stays bound by the host issuing them.
    assert at_192.forward_ms + at_192.backward_ms > gpu.time.forward_ms + gpu.time.backward_ms
    assert at_192.step_ms >= gpu.time.step_ms - 1e-9  # equal where the host bounds both (summed in another order)
    plain = forecast(gnn=None)
    with pytest.raises(ValueError, match=r"step_time: seq_len needs probes at several lengths"):
        plain.step_time(16, seq_len=64)
    with pytest.raises(ValueError, match=r"step_time: seq_len must be an integer of at least 1, got 0"):
        fc.step_time(16, seq_len=0)


def test_frozen_layers_are_forecast_without_a_backward_pass():
    # Fine-tuning a head: the first two layers frozen, so their backward never runs. The untimed frozen layer's
    # kind model would give it one (the forecast of a frozen ResNet-18 backbone doubled the step).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 10))
    for p in [*model[0].parameters(), *model[1].parameters()]:
        p.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(batch):
        x, y = batch
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    def make_batch(n):
        g = torch.Generator().manual_seed(n)
        return torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)

    fc = gpucast.forecast(step, make_batch, 64, model=model, optimizer=opt, time_fraction=0.25, gnn=None)
    layers = {x["layer"]: x for x in fc.time.per_layer}
    assert [layers[n]["source"] for n in ("Sequential.0", "Sequential.1")] == ["measured", "prior"]
    for frozen in ("Sequential.0", "Sequential.1"):
        assert layers[frozen]["backward_ms"] == 0 and layers[frozen]["grad_bytes"] == 0
        assert layers[frozen]["forward_ms"] > 0
    assert layers["Sequential.2"]["backward_ms"] > 0
    # The weight's gradient and the bias's (which autograd's engine reduces outside the node): the layer's.
    assert layers["Sequential.2"]["grad_bytes"] == (64 * 10 + 10) * 4
    assert layers["(outside modules)"]["grad_bytes"] == 0


def _device_timings(batches=(4, 8, 16)):
    """Iteration timings of three GPU probes (device clocks): one layer, 0.9 ms per sample."""
    return [json.dumps({"batch": b, "wall_ns": 1e6 * b, "optimizer_ns": 1e5, "other_ns": 0, "clock": "device",
                        "layers": [{"layer": "Net.a", "forward_ns": 3e5 * b, "backward_ns": 6e5 * b, "grad_bytes": 0,
                                    "backward_order": 0}]}) for b in batches]


def test_a_gpu_target_far_beyond_its_probes_gets_a_timing_probe_at_half_where_its_memory_fits():
    from gpucast._probes import _probe_fits, _reach_probes
    t = _device_timings()
    design = [(4, None), (8, None), (16, None)]
    asked = []

    def fits(b):
        asked.append(b)
        return True
    assert _reach_probes(t, 512, "H100-80GB", "cuda:0", design, fits) == [256]
    assert asked == [256]
    assert _reach_probes(t, 512, "H100-80GB", "cuda:0", design, lambda b: False) == []
    assert _reach_probes(t, 512, "H100-80GB", "cuda:0", design, None) == []  # no memory check: not on a GPU
    assert _reach_probes(t, 48, "H100-80GB", "cuda:0", design, fits) == []  # 3 times the largest probe at most
    asked.clear()
    assert _reach_probes(t, 5000, "H100-80GB", "cuda:0", design, fits) == []  # 2.3 s at 2500: over the budget
    assert asked == []  # the memory is not asked about then
    assert _reach_probes(t, 512, "H100-80GB", "cpu", design, fits) == []  # CPU probes priced for a GPU: nothing timed
    assert _reach_probes(t, 512, "H100-80GB", "cuda:0", [(4, 128), (8, 128), (16, 128)], fits) == []  # lengths
    # 80 % of the free memory and the allocator's reservation.
    assert _probe_fits(80, 60, 40) and not _probe_fits(81, 60, 40)


def test_an_internal_error_in_the_step_time_leaves_the_memory_forecast(monkeypatch):
    model, opt, step, make = _linear_case()

    real = torch.ops.gpucast.forecast_step_time

    def broken(probes, batch, *args, parallel="", **kwargs):  # the forecast's own call (with its parallel strategy)
        if parallel:
            raise RuntimeError("step time: the 1F1B schedule stopped at stage 1 of 2")
        return real(probes, batch, *args, parallel=parallel, **kwargs)
    monkeypatch.setattr(torch.ops.gpucast, "forecast_step_time", broken)
    with pytest.warns(UserWarning, match=r"gpucast.forecast: the step-time forecast failed \(RuntimeError: step time: "
                                         r"the 1F1B schedule stopped at stage 1 of 2\); no step time, the memory "
                                         r"forecast stands"):
        fc = gpucast.forecast(step, make, 64, model=model, optimizer=opt, probe_batch_sizes=(2, 4),
                              parallel=dict(dp=2), link="alpha_us:10,bytes_per_us:1000")
    assert fc.time is None and fc.memory.peak_allocated_bytes > 0



def test_timing_rounds_take_each_probes_median_over_the_rounds():
    case = zoo.CASES["mlp"]
    model, opt, step, _ = build(case, "sgd")

    def fc_with(**kw):
        return gpucast.forecast(step, case.make_batch, 16, model=model, optimizer=opt, gnn=None, **kw)

    fc = fc_with(timing_rounds=2)
    assert len(fc.timing_rounds) == 2
    assert [[json.loads(x)["batch"] for x in r] for r in fc.timing_rounds] == [[2, 4, 8], [2, 4, 8]]
    assert fc.timings == [torch.ops.gpucast.median_timing(list(xs)) for xs in zip(*fc.timing_rounds)]
    for i in range(3):  # every probe timed in each round: two medians of the same count of steps
        first, again = (json.loads(r[i]) for r in fc.timing_rounds)
        assert json.loads(fc.timings[i])["untraced_wall_ns"] == (first["untraced_wall_ns"] +
                                                                 again["untraced_wall_ns"]) / 2
        assert [x["layer"] for x in first["layers"]] == [x["layer"] for x in again["layers"]]
    one = fc_with(timing_rounds=1)
    assert one.timing_rounds == [] and [json.loads(x)["batch"] for x in one.timings] == [2, 4, 8]
    assert len(fc_with().timing_rounds) == 3  # probes on the CPU: three rounds by default
    # The timing-only probe nearer a far target is timed in every round too.
    far = gpucast.forecast(step, case.make_batch, 64, model=model, optimizer=opt, gnn=None, timing_rounds=2)
    assert [[json.loads(x)["batch"] for x in r] for r in far.timing_rounds] == [[2, 4, 8, 32]] * 2
    for bad in (0, True, 1.5, "3"):
        with pytest.raises(ValueError, match=rf"^forecast: timing_rounds must be an integer of at least 1 \(or None\), "
                                             rf"got {bad!r}$"):
            fc_with(timing_rounds=bad)
