"""Job descriptions (gpucast.describe), their estimate (gpucast.predict_job), and their validation."""
import json

import pytest
import torch

import gpucast
from conftest import build
from examples import zoo


def test_describe_a_decoder():
    case = zoo.CASES["gpt"]
    model, opt, step, batch = build(case, "adamw")
    job = gpucast.describe(model, case.make_batch, 32, optimizer=opt, loss_fn=case.loss_fn)
    assert job["schema_version"] == 1 and job["family"] == "transformer-decoder"
    assert job["batch_size"] == 32 and job["seq_len"] == 64 and job["optimizer"] == "adamw"
    assert sum(layer["params"] for layer in job["layers"]) == sum(p.numel() for p in model.parameters())
    linears = [x for x in job["layers"] if x["kind"] == "linear"]
    assert {tuple(x["dims"]) for x in linears} >= {(128, 384), (128, 512), (512, 128), (128, 128)}
    assert all(x["activation_bytes_per_sample"] >= 0 for x in job["layers"])
    assert sum(x["activation_bytes_per_sample"] for x in job["layers"]) > 0
    assert all(p.grad is None for p in model.parameters())  # the probe's gradients are discarded
    # Valid as written; the estimate is the sum of its parts.
    assert json.loads(torch.ops.gpucast.validate_job(json.dumps(job)))["layers"] == job["layers"]
    e = gpucast.predict_job(job, weights="")  # the analytical estimate, explicitly
    assert e["method"] == "analytical"
    assert e["notes"][0]["code"] == "learned-unavailable" and "no weights file" in e["notes"][0]["text"]
    assert e["bytes"] == sum(e[k] for k in ("parameter_bytes", "gradient_bytes", "optimizer_bytes",
                                            "activation_bytes", "input_bytes"))
    params = sum(p.numel() * 4 for p in model.parameters())
    assert e["parameter_bytes"] == params and e["gradient_bytes"] == params
    assert e["activation_bytes"] == 32 * sum(x["activation_bytes_per_sample"] for x in job["layers"])


def job(**over):
    j = {"schema_version": 1, "family": "mlp", "batch_size": 8,
         "layers": [{"kind": "linear", "dims": [16, 32], "params": 544, "activation_bytes_per_sample": 64}]}
    j.update(over)
    return j


@pytest.mark.parametrize("bad,message", [
    (dict(layers=[{"kind": "lstm_cell"}]),
     "job: field 'layers[0].kind' should be one of activation|attention|conv|dropout|embedding|linear|norm|other|pool|rnn, got \"lstm_cell\""),
    (dict(layers=[]), "job: field 'layers' is empty: a job needs at least one layer"),
    (dict(batch_size=0), "job: field 'batch_size' should be an integer from 1 to 17592186044416, got 0"),
    (dict(batch_size=10**15), "job: field 'batch_size' should be an integer from 1 to 17592186044416, got 1000000000000000"),
    (dict(schema_version=2), "job: job schema_version 2 is not supported (reads version 1)"),
    (dict(dtype="int8"), "job: field 'dtype' should be one of float32|float16|bfloat16|float64, got \"int8\""),
])
def test_bad_job_descriptions(bad, message):
    with pytest.raises(ValueError) as e:
        gpucast.predict_job(job(**bad))
    assert str(e.value).splitlines()[0] == "[gpucast:job-file] " + message


def test_missing_job_file_is_named(tmp_path):
    with pytest.raises(OSError, match=f"cannot read '{tmp_path / 'nope.json'}': No such file or directory"):
        gpucast.predict_job(str(tmp_path / "nope.json"))


def test_estimate_by_hand():
    e = gpucast.predict_job(job(optimizer="sgd_momentum", input_bytes_per_sample=64), weights="")
    # params 544 x 4 B; gradients the same; one momentum buffer; 8 samples x 64 B activations and inputs.
    assert (e["parameter_bytes"], e["gradient_bytes"], e["optimizer_bytes"]) == (2176, 2176, 2176)
    assert (e["activation_bytes"], e["input_bytes"], e["bytes"]) == (512, 512, 2176 * 3 + 1024)
    ddp = gpucast.predict_job(job(optimizer="sgd", world_size=2, strategy="ddp", batch_size=16), weights="")
    assert ddp["gradient_bytes"] == 2 * 2176 and ddp["activation_bytes"] == 512
