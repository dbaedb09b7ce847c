"""pip install --no-build-isolation builds the plugin against the installed torch; the package then works from
anywhere, and refuses, with a message that says how to rebuild, a torch other than the one it was built with."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpucast._loader import check_torch

ROOT = Path(__file__).resolve().parents[2]


def test_another_torch_is_refused_with_how_to_rebuild():
    with pytest.raises(ImportError, match=r"gpucast was built against torch 2\.11\.0, but this is torch 2\.14\.1\+cu130; "
                                          r"rebuild it against this torch: pip install --no-build-isolation"):
        check_torch("2.11.0", "2.14.1+cu130")
    check_torch("2.14.1", "2.14.1+cu130")  # local version labels do not matter
    check_torch(None, "2.14.1")  # a source tree


def test_pip_install_then_run_from_another_directory(tmp_path):
    target = tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                            "--disable-pip-version-check", "--quiet", "--target", str(target), str(ROOT)],
                           capture_output=True, text=True, timeout=1500)
    assert build.returncode == 0, build.stderr[-3000:]
    assert (target / "gpucast" / "lib" / "libgpucast.so").is_file()
    assert (target / "gpucast" / "_build_info.py").is_file()
    assert (target / "gpucast" / "data" / "job_memory.gcw").is_file()
    env = dict(os.environ, PYTHONPATH=str(target))
    for k in ("GPUCAST_LIBRARY", "GPUCAST_CONF", "GPUCAST_LOG"):
        env.pop(k, None)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([sys.executable, "-c", "import gpucast; print(gpucast.library_path())"], cwd=elsewhere,
                           env=env, capture_output=True, text=True, timeout=300)
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip() == str(target / "gpucast" / "lib" / "libgpucast.so")
    # The installed package answers job-level predictions with its shipped weights.
    job = elsewhere / "job.json"
    job.write_text(json.dumps({"schema_version": 1, "family": "mlp", "batch_size": 8, "layers": [
        {"kind": "linear", "dims": [16, 32], "params": 544, "activation_bytes_per_sample": 64}]}))
    pj = subprocess.run([sys.executable, "-m", "gpucast", "predict-job", str(job)], cwd=elsewhere, env=env,
                        capture_output=True, text=True, timeout=300)
    assert pj.returncode == 0, pj.stderr
    assert pj.stdout.splitlines()[0].endswith("MiB per rank (learned)")
    # The example finds gpucast installed (no source-tree fallback needed) and runs with auto mode on.
    run = subprocess.run([sys.executable, "-m", "gpucast", "run", "--target", "A100-80GB", "--",
                          str(ROOT / "examples" / "gpt.py"), "--no-trace", "--steps", "2"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "gpucast forecast for A100-80GB, batch 8:" in run.stderr
