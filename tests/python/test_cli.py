"""python -m gpucast: devices, report, run."""
import json
import os
import subprocess
import sys
from pathlib import Path

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
    (tmp_path / "bad.json").write_text('{"schema_version": 3}')
    out = cli("report", "bad.json", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == ("gpucast: [gpucast:trace-file] bad.json: trace schema_version 3 is not supported by this gpucast "
                                  "(reads versions 1 to 2); record the trace again with this version")


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
    assert "note: bigru-transformer model v1 trained on " in out.stdout
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
