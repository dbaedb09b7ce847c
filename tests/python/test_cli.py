"""python -m gpucast: devices, report, run."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gpucast
from conftest import build
from examples import zoo

ROOT = Path(__file__).resolve().parents[2]


def cli(*args, cwd=None, env_extra=None):
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'python'}{os.pathsep}{ROOT}")
    env.pop("GPUCAST_CONF", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "gpucast", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)


def test_devices_lists_the_table():
    out = cli("devices")
    assert out.returncode == 0, out.stderr
    memory, rates = out.stdout.split("\n\n")
    lines = memory.splitlines()
    assert lines[0].split() == ["name", "capacity", "cc", "context", "default", "link", "(parallel", "forecasts)",
                                "source"]
    assert [ln.split()[0] for ln in lines[1:]] == [d["name"] for d in gpucast.devices()]
    assert "H100-80GB      81,559 MiB   9.0   560 MiB  intra:nvlink4,gpus_per_node:8,inter:ib-ndr " in out.stdout
    lines = rates.splitlines()
    assert lines[0] == "step time from CPU probes (gpu_rates table):"
    assert [ln.split()[0] for ln in lines[2:]] == [g["name"] for g in gpucast.gpu_rates()]
    assert "H100-80GB    66.9 TF  495 TF  989 TF  3352 GB/s  NeuSight per-operator latencies on" in rates


def test_report_of_a_saved_trace(tmp_path):
    model, opt, step, batch = build(zoo.CASES["gpt"], "adamw")
    with gpucast.trace() as t:
        step(batch)
    t.save(str(tmp_path / "trace.json"))
    out = cli("report", "trace.json", "--html", "r.html", "--png", "r.png", "--snapshot", "s.pickle", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(t.summary())
    for name in ("r.html", "r.png", "s.pickle"):
        assert (tmp_path / name).stat().st_size > 1000, name


def test_report_of_a_bad_file_names_it(tmp_path):
    (tmp_path / "bad.json").write_text('{"schema_version": 99}')
    out = cli("report", "bad.json", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == ("gpucast: [gpucast:trace-file] bad.json: trace schema_version 99 is not supported by this gpucast "
                                  "(reads versions 1 to 3); record the trace again with this version")


def test_run_an_unmodified_script_from_another_directory(tmp_path):
    log = tmp_path / "f.jsonl"
    out = cli("run", "--target", "H100-80GB", "--log", str(log), "--", str(ROOT / "examples" / "gpt.py"),
              "--no-trace", "--steps", "2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "step 2 loss" in out.stdout
    assert "gpucast forecast for H100-80GB, batch 8:" in out.stderr
    rec = json.loads(log.read_text().splitlines()[0])
    assert rec["memory"]["target"] == "H100-80GB" and rec["memory"]["peak_reserved_bytes"] > 0


def test_predict_job(tmp_path):
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"schema_version": 1, "family": "mlp", "batch_size": 8, "layers": [
        {"kind": "linear", "dims": [16, 32], "params": 544, "activation_bytes_per_sample": 64}]}))
    out = cli("predict-job", str(path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].startswith(f"{path}: ") and out.stdout.splitlines()[0].endswith(
        " MiB per rank (learned)")
    assert "note: bigru-transformer model v2 trained on " in out.stdout
    missing = tmp_path / "none.gcw"
    out = cli("predict-job", str(path), "--weights", str(missing))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == f"{path}: 0.0 MiB per rank (analytical)"
    assert (f"note: learned model unavailable: cannot open weights file '{missing}': No such file or directory; "
            "analytical estimate") in out.stdout
    path.write_text('{"schema_version": 1, "layers": []}')
    bad = cli("predict-job", str(path))
    assert bad.returncode == 2
    assert "field 'layers' is empty" in bad.stderr


def test_predict_job_from_a_transformers_config(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
                                  "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4}))
    out = cli("predict-job", "--hf-config", str(config), "--batch", "8", "--seq-len", "32", "--gpus", "4",
              "--tp", "2", "--strategy", "fsdp", "--weights", str(tmp_path / "none.gcw"))
    assert out.returncode == 0, out.stderr
    job = gpucast.describe_config(str(config), 8, seq_len=32, world_size=4, tp=2, strategy="fsdp")
    est = gpucast.predict_job(job, weights=str(tmp_path / "none.gcw"))
    assert out.stdout.splitlines()[0] == f"{config}: {est['bytes'] / 2**20:,.1f} MiB per rank (analytical)"
    bad = cli("predict-job", "--hf-config", str(config), "--batch", "8")
    assert bad.returncode == 2 and "settings: field 'seq_len' missing: a llama job needs one" in bad.stderr
    assert "give a job description file, or --hf-config" in cli("predict-job").stderr


def test_run_refuses_an_unknown_target_before_the_script_starts(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('the script ran')\n")
    out = cli("run", "--target", "B200", "--", str(script), cwd=tmp_path)
    assert out.returncode == 2 and "the script ran" not in out.stdout
    assert out.stderr.strip().splitlines() == [
        "gpucast: [gpucast:auto-config] GPUCAST_CONF: option 'target' expects auto, cpu or a device table name (cpu, "
        "A100-40GB, A100-80GB, H100-80GB, H200-141GB, L4, V100-32GB, RTX-4090), or any name with capacity_mb, got 'B200'"]
    fine = cli("run", "--target", "B200", "--", str(script), cwd=tmp_path, env_extra={"GPUCAST_CONF": "capacity_mb:196608"})
    assert fine.returncode == 0 and "the script ran" in fine.stdout, fine.stderr


def test_report_draws_forecast_and_capacity_lines(tmp_path):
    model, opt, step, batch = build(zoo.CASES["mlp"], "adamw")
    with gpucast.trace() as t:
        step(batch)
    t.save(str(tmp_path / "trace.json"))
    out = cli("report", "trace.json", "--forecast", "1234MiB", "--capacity", "H100-80GB", "--html", "r.html",
              "--png", "r.png", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    h100 = next(d for d in gpucast.devices() if d["name"] == "H100-80GB")["capacity_bytes"]
    text = (tmp_path / "r.html").read_text()
    assert "forecast peak 1,234.0 MiB" in text and f"capacity {h100 / 2**20:,.1f} MiB" in text
    assert (tmp_path / "r.png").stat().st_size > 1000
    bad = cli("report", "trace.json", "--forecast", "12 parsecs", "--png", "r.png", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stdout == ""
    assert "argument --forecast: '12 parsecs' is not a size: give bytes (1234567), or a number with a unit: " \
           "KiB, MiB, GiB, TiB (powers of 1024) or kB, MB, GB, TB (powers of 1000)" in bad.stderr


def test_sizes_on_the_command_line():
    from gpucast.__main__ import parse_size
    assert parse_size("1234MiB") == 1234 * 2**20
    assert parse_size("2GiB") == parse_size("2 gib") == 2 * 2**30
    assert parse_size("1.5GiB") == 3 * 2**29
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("123456") == parse_size("123456B") == 123456
    assert parse_size("H100-80GB", devices=True) == next(
        d["capacity_bytes"] for d in gpucast.devices() if d["name"] == "H100-80GB")
    for bad in ("", "-1GiB", "1.5", "GiB", "12 parsecs", "H100-80GB"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_report_pictures_without_matplotlib(tmp_path):
    """One line naming the package and the pip command, exit code 2, before the summary."""
    model, opt, step, batch = build(zoo.CASES["mlp"], "adamw")
    with gpucast.trace() as t:
        step(batch)
    t.save(str(tmp_path / "trace.json"))
    for option in ("--png", "--html"):
        code = ("import sys; sys.modules['matplotlib'] = None; from gpucast.__main__ import main; "
                f"sys.exit(main(['report', 'trace.json', '{option}', 'out']))")
        env = dict(os.environ, PYTHONPATH=f"{ROOT / 'python'}{os.pathsep}{ROOT}")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                             timeout=300)
        assert out.returncode == 2
        assert out.stderr == f"gpucast report {option} needs matplotlib: pip install matplotlib\n"
        assert out.stdout == "" and not (tmp_path / "out").exists()


def test_run_conf_turns_auto_mode_on_and_target_wins():
    from gpucast.__main__ import _run_conf
    assert _run_conf("", None) == "enabled:True"
    assert _run_conf("enabled:False,target:L4,verbose:True", None) == "enabled:True,target:L4,verbose:True"
    assert _run_conf("target:L4,capacity_mb:100", "H100-80GB") == "enabled:True,capacity_mb:100,target:H100-80GB"


TINY_TRAIN = """
import torch
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
opt = torch.optim.AdamW(model.parameters())
for _ in range(3):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(torch.randn(16, 32)), torch.randint(0, 10, (16,))).backward()
    opt.step()
"""


def test_run_saves_the_traced_iteration_for_report(tmp_path):
    (tmp_path / "train.py").write_text(TINY_TRAIN)
    out = cli("run", "--target", "cpu", "--save-trace", "first.json", "--log", "f.jsonl", "--", "train.py",
              cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    t = gpucast.load_trace(str(tmp_path / "first.json"))
    phases = {op.phase for op in t.ops}
    assert phases == {"forward", "backward", "optimizer"}
    params = sum(a.block_bytes for a in t.allocations if a.category == "parameter")
    assert params >= (32 * 64 + 64 + 64 * 10 + 10) * 4  # the model's weights, told apart as auto mode tells them
    rec = json.loads((tmp_path / "f.jsonl").read_text().splitlines()[0])
    assert rec["memory"]["peak_allocated_bytes"] > 0
    report = cli("report", "first.json", cwd=tmp_path)
    assert report.returncode == 0 and report.stdout.startswith("gpucast trace: "), report.stderr


def test_run_says_once_when_the_trace_cannot_be_saved(tmp_path):
    (tmp_path / "train.py").write_text(TINY_TRAIN)
    out = cli("run", "--target", "cpu", "--save-trace", str(tmp_path / "missing" / "t.json"), "--", "train.py",
              cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("gpucast: the traced iteration was not saved to GPUCAST_TRACE: ") == 1
    assert "gpucast forecast for cpu" in out.stderr


_TINY_LLAMA = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 256}


def test_plan_ranks_the_layouts_of_a_config_over_the_gpus(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(_TINY_LLAMA))
    r = cli("plan", str(cfg), "--gpus", "8", "--seq", "128", "--batch", "2", "--dp-modes", "fsdp,ddp", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["gpus"] == 8 and out["gpu"] == "H100-80GB"
    names = [x["name"] for x in out["layouts"]]
    assert sorted(names) == ["ddp8", "ddp8, ckpt", "fsdp8", "fsdp8, ckpt"]
    steps = [x["step_ms"] for x in out["layouts"]]
    assert all(x["fits"] for x in out["layouts"]) and steps == sorted(steps)  # all fit: fastest first
    by = {x["name"]: x for x in out["layouts"]}
    assert by["fsdp8"]["allocated_bytes"] < by["ddp8"]["allocated_bytes"]  # sharded states
    assert by["fsdp8, ckpt"]["allocated_bytes"] < by["fsdp8"]["allocated_bytes"]  # activations recomputed
    table = cli("plan", str(cfg), "--gpus", "8", "--seq", "128", "--checkpointing", "none")
    assert table.returncode == 0 and table.stdout.splitlines()[1].split() == [
        "layout", "allocated", "GiB", "reserved", "GiB", "fits", "step", "ms", "tokens/s/GPU"]


def test_plan_refuses_bad_input_naming_it(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(_TINY_LLAMA))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hidden_size": 64}))
    cases = [
        (("plan", str(bad), "--gpus", "8", "--seq", "128"), "field 'model_type' missing"),
        (("plan", str(cfg), "--gpus", "8", "--seq", "128", "--tp", "3"), "--tp 3 does not divide --gpus 8"),
        (("plan", str(cfg), "--gpus", "8", "--seq", "128", "--gpu", "B300"), "B300"),
        (("plan", str(cfg), "--gpus", "8", "--seq", "128", "--dp-modes", "zero3"), "--dp-modes takes ddp and fsdp"),
        (("plan", str(tmp_path / "missing.json"), "--gpus", "8", "--seq", "128"), "cannot read the config"),
    ]
    for args, message in cases:
        r = cli(*args)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)
