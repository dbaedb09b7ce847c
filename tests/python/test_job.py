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
    assert job["schema_version"] == 2 and job["family"] == "transformer-decoder"
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
    (dict(schema_version=3), "job: job schema_version 3 is not supported (reads versions 1 and 2)"),
    (dict(tp=2), "job: field 'tp' needs schema_version 2 (this description says 1)"),
    (dict(schema_version=2, world_size=6, tp=4), "job: field 'world_size' is 6, not a multiple of tp x pp = 4 x 1"),
    (dict(schema_version=2, world_size=4, pp=4, micro_batches=2),
     "job: field 'micro_batches' is 2, fewer than the 4 pipeline stages (pp): every stage needs a micro-batch in flight"),
    (dict(schema_version=2, target=7), "job: field 'target' should be a GPU's name (a string of at most 64 characters), got 7"),
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


# Small configs of every model type gpucast describes from a config, as transformers builds each (on meta).
HF_CONFIGS = [
    dict(model_type="llama", vocab_size=1000, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=2),
    dict(model_type="mistral", vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=1, sliding_window=64),
    dict(model_type="qwen2", vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    dict(model_type="qwen3", vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    dict(model_type="gemma", vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=1, head_dim=128),
    dict(model_type="gpt2", vocab_size=1000, n_embd=128, n_layer=2, n_head=4),
    dict(model_type="mixtral", vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    dict(model_type="qwen2_moe", vocab_size=1000, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
         shared_expert_intermediate_size=256, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=2),
    dict(model_type="olmoe", vocab_size=1000, hidden_size=256, intermediate_size=128, num_experts=8,
         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4),
    dict(model_type="bert", vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
         intermediate_size=512, num_labels=3),
    dict(model_type="roberta", vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
         intermediate_size=512, num_labels=3),
    dict(model_type="vit", hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
         image_size=64, patch_size=16, num_labels=10),
]


@pytest.mark.parametrize("config", HF_CONFIGS, ids=[c["model_type"] for c in HF_CONFIGS])
def test_describe_config_counts_the_parameters_transformers_builds(config):
    from transformers import (AutoConfig, AutoModelForCausalLM, BertForSequenceClassification,
                              RobertaForSequenceClassification, ViTForImageClassification)
    fields = dict(config)
    conf = AutoConfig.for_model(fields.pop("model_type"), **fields)
    kind = {"bert": BertForSequenceClassification, "roberta": RobertaForSequenceClassification,
            "vit": ViTForImageClassification}.get(config["model_type"])
    with torch.device("meta"):
        model = kind(conf) if kind else AutoModelForCausalLM.from_config(conf)
    job = gpucast.describe_config(config, 4, seq_len=None if config["model_type"] == "vit" else 32)
    assert job["schema_version"] == 2
    assert sum(x["params"] for x in job["layers"]) == sum(p.numel() for p in model.parameters())
    assert all(x["activation_bytes_per_sample"] >= 0 for x in job["layers"])
    assert gpucast.predict_job(job)["bytes"] > 0
