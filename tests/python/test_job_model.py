"""The learned job-level memory model: the dataset's reproducibility, the shipped weights, their validation and
fallback, gpucast-train, and input validation."""
import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpucast
from conftest import rewrite_weights_header

ROOT = Path(__file__).resolve().parents[2]
DATASET = ROOT / "bench/dataset/jobs.jsonl.gz"
TRAIN = ROOT / "build/bin/gpucast-train"
FIX = "; retrain with gpucast-train or reinstall gpucast to get the shipped weights"


def rows(n=None):
    out = []
    with gzip.open(DATASET, "rt", encoding="utf-8") as f:
        for line in f:
            out.append(json.loads(line))
            if n is not None and len(out) == n:
                break
    return out


def test_dataset_is_complete():
    data = rows()
    assert len(data) >= 3000
    assert [r["id"] for r in data] == list(range(len(data)))
    fams = {r["family"] for r in data}
    assert fams == {"mlp", "cnn", "rnn", "transformer-encoder", "transformer-decoder", "vit"}
    assert all(r["label_bytes"] > 0 and r["label_source"] in ("measured", "forecast") for r in data)
    assert all(r["label_bytes"] == (r["measured_bytes"] if r["label_source"] == "measured" else r["forecast_bytes"])
               for r in data)


def test_same_seed_same_rows():
    """Jobs regenerated from the dataset's seed in a fresh process equal the committed rows, label included."""
    data = rows(13)
    ids = [0, 6, 12]  # multilayer perceptrons: quick to rerun
    out = subprocess.run(
        [sys.executable, "-c",
         "import json, sys; sys.path[:0] = ['.', 'python', 'bench/dataset']; import generate as g; "
         f"print(json.dumps([g.run_job(i, g.SEED, 10) for i in {ids}]))"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH="python:."))
    assert out.returncode == 0, out.stderr
    again = json.loads(out.stdout.strip().splitlines()[-1])
    for i, row in zip(ids, again):
        # gpucast.describe writes job schema 2 since the committed rows were made with schema 1, whose fields it
        # keeps as they were (version 1 is read as version 2 with one rank of each and no target).
        assert (row["job"].pop("schema_version"), data[i]["job"].pop("schema_version")) == (2, 1)
        assert row == data[i]


def test_shipped_weights_answer():
    path = torch.ops.gpucast.job_weights_path()
    assert path.endswith(os.path.join("data", "job_memory.gcw")) and os.path.exists(path)
    data = rows(60)
    errs = []
    for r in data:
        e = gpucast.predict_job(r["job"])
        assert e["method"] == "learned", e["notes"]
        assert e["notes"][0]["code"] == "learned" and "v2 trained on " in e["notes"][0]["text"]
        errs.append(abs(e["bytes"] - r["label_bytes"]) / r["label_bytes"])
    errs.sort()
    assert errs[len(errs) // 2] < 0.10  # median relative error on jobs the dataset holds


JOB = {"schema_version": 1, "family": "mlp", "batch_size": 8,
       "layers": [{"kind": "linear", "dims": [16, 32], "params": 544, "activation_bytes_per_sample": 64}]}


@pytest.fixture
def weights(tmp_path):
    p = tmp_path / "w.gcw"
    shutil.copyfile(torch.ops.gpucast.job_weights_path(), p)
    return p


def fallback_note(path):
    e = gpucast.predict_job(JOB, weights=str(path))
    assert e["method"] == "analytical"
    assert e["bytes"] == gpucast.predict_job(JOB, weights="")["bytes"]  # the same analytical estimate
    assert e["notes"][0]["code"] == "learned-unavailable"
    return e["notes"][0]["text"]


def test_missing_weights_fall_back(tmp_path):
    p = tmp_path / "nope.gcw"
    assert fallback_note(p) == (f"learned model unavailable: cannot open weights file '{p}': No such file or "
                                "directory; analytical estimate")


def test_truncated_weights_fall_back(weights):
    b = weights.read_bytes()
    weights.write_bytes(b[:len(b) // 2])
    assert fallback_note(weights) == (
        f"learned model unavailable: weights file '{weights}' is corrupt or truncated: its checksum does not match "
        f"its {len(b) // 2} bytes{FIX}; analytical estimate")


def test_corrupt_weights_fall_back(weights):
    b = bytearray(weights.read_bytes())
    b[len(b) // 2] ^= 0x01
    weights.write_bytes(bytes(b))
    assert fallback_note(weights) == (
        f"learned model unavailable: weights file '{weights}' is corrupt or truncated: its checksum does not match "
        f"its {len(b)} bytes{FIX}; analytical estimate")
    weights.write_bytes(b"not weights at all")
    assert fallback_note(weights) == (
        f"learned model unavailable: '{weights}' is not a gpucast weights file (it does not start with "
        f"\"GPUCASTJ\"){FIX}; analytical estimate")


def test_other_versions_fall_back(weights, tmp_path):
    b = bytearray(weights.read_bytes())
    b[8] = 2
    other = tmp_path / "v2.gcw"
    other.write_bytes(bytes(b))
    assert fallback_note(other) == (f"learned model unavailable: weights file '{other}' has format version 2; this "
                                    f"gpucast reads version 1{FIX}; analytical estimate")
    model_v1 = tmp_path / "model_v1.gcw"
    rewrite_weights_header(weights, model_v1, model_version=1)
    assert fallback_note(model_v1) == (f"learned model unavailable: weights file '{model_v1}' holds model version 1; "
                                       f"this gpucast reads version 2{FIX}; analytical estimate")
    features_v9 = tmp_path / "features_v9.gcw"
    rewrite_weights_header(weights, features_v9, feature_version=9)
    assert fallback_note(features_v9) == (
        f"learned model unavailable: weights file '{features_v9}' was trained on job features version 9; this "
        f"gpucast computes version 2{FIX}; analytical estimate")
    other_model = tmp_path / "other.gcw"
    rewrite_weights_header(weights, other_model, model="random-forest")
    assert fallback_note(other_model) == (
        f"learned model unavailable: weights file '{other_model}' holds model \"random-forest\", expected "
        f"\"bigru-transformer\"{FIX}; analytical estimate")


def test_environment_variable_names_the_weights(tmp_path):
    p = tmp_path / "nope.gcw"
    out = subprocess.run(
        [sys.executable, "-c", "import json, gpucast; print(json.dumps(gpucast.predict_job("
         f"{json.dumps(JOB)!r})))"], capture_output=True, text=True, timeout=120,
        env=dict(os.environ, GPUCAST_JOB_WEIGHTS=str(p), PYTHONPATH=f"{ROOT / 'python'}"))
    assert out.returncode == 0, out.stderr
    e = json.loads(out.stdout.strip().splitlines()[-1])
    assert e["method"] == "analytical" and f"cannot open weights file '{p}'" in e["notes"][0]["text"]


def test_model_input_validation():
    too_long = dict(JOB, layers=JOB["layers"] * 4097)
    with pytest.raises(ValueError) as e:
        gpucast.predict_job(too_long)
    assert str(e.value).splitlines()[0] == (
        "[gpucast:job-file] job: field 'layers' has 4097 layers; the job-level model reads at most 4096 "
        "(leaf modules)")
    with pytest.raises(ValueError) as e:
        gpucast.predict_job(dict(JOB, layers=[{"kind": "linear", "params": -5}]))
    assert str(e.value).splitlines()[0] == (
        "[gpucast:job-file] job: field 'layers[0].params' should be an integer from 0 to 17592186044416, got -5")


def _write(path, data):
    with open(path, "w") as f:
        for r in data:
            f.write(json.dumps({"job": r["job"], "label_bytes": r["label_bytes"]}) + "\n")


def test_training_is_deterministic(tmp_path):
    data = rows(48)
    _write(tmp_path / "train.jsonl", data[:36])
    _write(tmp_path / "val.jsonl", data[36:])
    outs = []
    for k in range(2):
        out = subprocess.run([str(TRAIN), "--train", str(tmp_path / "train.jsonl"), "--val",
                              str(tmp_path / "val.jsonl"), "--out", str(tmp_path / f"w{k}.gcw"), "--epochs", "3",
                              "--seed", "7", "--threads", "1"], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        info = json.loads(out.stdout)
        assert (info["train_jobs"], info["val_jobs"], info["epochs"]) == (36, 12, 3)
        outs.append((tmp_path / f"w{k}.gcw").read_bytes())
    assert outs[0] == outs[1]
    e = gpucast.predict_job(data[0]["job"], weights=str(tmp_path / "w0.gcw"))
    assert e["method"] == "learned" and e["notes"][0]["code"] == "learned" and "trained on 36 jobs" in e["notes"][0]["text"]


def test_training_bad_input(tmp_path):
    def run(*args):
        return subprocess.run([str(TRAIN), *args], capture_output=True, text=True, timeout=60)
    r = run("--train", "x.jsonl")
    assert r.returncode == 2 and r.stderr.startswith("gpucast-train: --train, --val and --out are required")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"job": {"schema_version": 1, "batch_size": 2, "layers": [{"kind": "linear"}]}, '
                   '"label_bytes": 100}\n{"job": 3}\n')
    r = run("--train", str(bad), "--val", str(bad), "--out", str(tmp_path / "w.gcw"))
    assert r.returncode == 2
    assert r.stderr.strip() == f'{bad}:2: expected {{"job": {{...}}, "label_bytes": <integer>}}'
    bad.write_text('{"job": {"schema_version": 1, "batch_size": 2, "layers": [{"kind": "lstm"}]}, '
                   '"label_bytes": 100}\n')
    r = run("--train", str(bad), "--val", str(bad), "--out", str(tmp_path / "w.gcw"))
    assert r.returncode == 2 and r.stderr.startswith(f"{bad}:1: field 'layers[0].kind' should be one of")
    r = run("--epochs", "many")
    assert r.returncode == 2 and r.stderr.strip() == "gpucast-train: --epochs expects a whole number >= 0, got 'many'"
    assert not (tmp_path / "w.gcw").exists()


def test_learned_answer_has_reserved_and_flags_jobs_outside_the_training_range():
    job = rows(1)[0]["job"]  # a job of the training set's kind
    e = gpucast.predict_job(job)
    assert e["method"] == "learned" and e["reserved_bytes"] >= e["bytes"] > 0 and e["out_of_range"] is False
    analytical = gpucast.predict_job(job, weights="")
    assert analytical["reserved_bytes"] is None and analytical["analytical_bytes"] == analytical["bytes"]
    assert e["analytical_bytes"] == analytical["bytes"]
    # 405B parameters over 4,096 GPUs: beyond every job the shipped model was trained on.
    big = gpucast.describe_config({"model_type": "llama", "vocab_size": 128256, "hidden_size": 16384,
                                   "intermediate_size": 53248, "num_hidden_layers": 126, "num_attention_heads": 128,
                                   "num_key_value_heads": 8}, 4096, seq_len=8192, dtype="bfloat16",
                                  world_size=4096, strategy="fsdp", target="H100-80GB")
    e = gpucast.predict_job(big)
    assert e["out_of_range"] is True
    codes = [n["code"] for n in e["notes"]]
    assert codes[0] in ("learned", "learned-implausible") and codes[1] == "learned-out-of-range"
    assert e["notes"][1]["text"].startswith("the job lies outside the learned model's training range (parameters ")
    assert e["analytical_bytes"] == gpucast.predict_job(big, weights="")["bytes"]
