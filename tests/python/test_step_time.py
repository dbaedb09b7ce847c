"""Step-time forecast through gpucast.forecast(): fields, the timeline file, DDP buckets and bad input."""
import json

import pytest

import gpucast
from conftest import build
from examples import zoo


def forecast(**kw):
    case = zoo.CASES["gpt"]
    model, opt, step, _ = build(case, "adamw")
    return gpucast.forecast(step, case.make_batch, kw.pop("batch", 16), model=model, optimizer=opt, **kw)


def test_time_fields_and_timeline(tmp_path):
    fc = forecast()
    t = fc.time
    assert t.clock == "cpu" and t.dp == 1 and t.per_rank_batch == 16
    assert t.step_ms == pytest.approx(t.forward_ms + t.backward_ms + t.optimizer_ms + t.other_ms)
    assert t.compute_ms == pytest.approx(t.step_ms) and t.exposed_comm_ms == 0 and t.buckets == []
    assert t.notes == []
    layers = [x["layer"] for x in t.per_layer]
    assert layers[:4] == ["(outside modules)", "GPT", "GPT.tok_emb", "GPT.pos_emb"]
    assert {"GPT.blocks.0.attn.qkv", "GPT.blocks.1.mlp.2", "GPT.head"} <= set(layers)
    assert sum(x["forward_ms"] for x in t.per_layer) == pytest.approx(t.forward_ms)
    assert all(x["forward_ms"] >= 0 and x["backward_ms"] >= 0 for x in t.per_layer)
    # Gradient bytes: every parameter's gradient, attributed to its layer.
    assert sum(x["grad_bytes"] for x in t.per_layer) >= 4 * sum(
        p.numel() for p in zoo.CASES["gpt"].make_model().parameters())
    assert "step time" in str(fc)
    path = tmp_path / "step.json"
    fc.save_timeline(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 1 + 2 * len(t.per_layer) + 1
    assert spans[-1]["name"] == "optimizer step"
    assert spans[-1]["ts"] + spans[-1]["dur"] == pytest.approx(t.step_ms * 1e3)


def test_ddp_buckets_over_a_link():
    fc = forecast(batch=32, parallel=dict(dp=2), link={"alpha_us": 20.0, "bytes_per_us": 500.0})
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
    no_link = forecast(batch=32, parallel=dict(dp=2)).time
    assert no_link.notes[0] == ("no all-reduce link given (gpucast.calibrate() or a device table): "
                                "communication not counted")


def test_gpu_target_from_cpu_probes_has_no_step_time():
    assert forecast(target="A100-80GB").time is None
    with pytest.raises(ValueError, match="save_timeline: this forecast has no step time"):
        forecast(target="A100-80GB").save_timeline("x.json")


@pytest.mark.parametrize("kw,message", [
    (dict(link={"alpha": 1}), "forecast: link should be a dict with alpha_us and bytes_per_us (what "
                              "gpucast.calibrate() returns), got {'alpha': 1}"),
    (dict(parallel=dict(dp=2, dp_mode="fsdp"), link={"alpha_us": 1, "bytes_per_us": 1}),
     "parallel: the step-time forecast models dp_mode 'ddp' only so far, got 'fsdp'"),
])
def test_bad_step_time_input(kw, message):
    with pytest.raises(ValueError) as e:
        forecast(batch=32, **kw)
    assert str(e.value).splitlines()[0] == message
