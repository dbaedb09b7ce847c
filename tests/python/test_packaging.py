"""pip install --no-build-isolation builds the plugin against the installed torch; the package then works from
anywhere, and refuses, with a message that says how to rebuild, a torch other than the one it was built with."""
import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
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


def readme_install_commands() -> list:
    """The README's install block, command by command (the block the docs test leaves to this one)."""
    from test_docs import blocks
    for b in blocks(ROOT / "README.md"):
        if b["lang"] == "sh" and b["skip"] and "test_packaging" in b["skip"]:
            return [w for w in (shlex.split(line, comments=True) for line in b["body"].splitlines()) if w]
    raise AssertionError("README.md has no install block whose 'not run' note names test_packaging")


def fresh_venv(where: Path, with_torch: bool) -> Path:
    """A new virtual environment without gpucast; with_torch: torch and the project's pinned packages visible
    through a .pth file naming this environment's site-packages (as if installed there: no download needed)."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, capture_output=True, timeout=300)
    if with_torch:
        purelib = subprocess.run([str(where / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip()
        (Path(purelib) / "_torch_from_project_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return where / "bin" / "python"


def clean_env() -> dict:
    env = dict(os.environ)
    for k in ("PYTHONPATH", "GPUCAST_LIBRARY", "GPUCAST_CONF", "GPUCAST_LOG", "VIRTUAL_ENV"):
        env.pop(k, None)
    return env


def test_a_missing_build_requirement_is_named_with_its_pip_command(tmp_path):
    python = fresh_venv(tmp_path / "venv", with_torch=False)
    out = subprocess.run([str(python), "-m", "pip", "install", "--no-build-isolation", "--disable-pip-version-check",
                          str(ROOT)], capture_output=True, text=True, timeout=600, env=clean_env())
    assert out.returncode != 0
    assert "gpucast: the build needs scikit-build-core, torch, which this Python does not have" in out.stdout + out.stderr
    assert "    pip install scikit-build-core torch" in out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr


FORECAST = """
import torch, gpucast
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
opt = torch.optim.AdamW(model.parameters())
def make_batch(n): return torch.randn(n, 32), torch.randint(0, 10, (n,))
def step(b):
    opt.zero_grad(); torch.nn.functional.cross_entropy(model(b[0]), b[1]).backward(); opt.step()
fc = gpucast.forecast(step, make_batch, 64, model=model, optimizer=opt, target="H100-80GB", timing_rounds=1)
print(fc.memory.target, fc.memory.peak_allocated_bytes > 0, gpucast.library_path())
"""


def test_the_readme_install_then_use_from_another_directory(tmp_path):
    """The README's install commands, as written, in a fresh virtual environment that has torch; then the CLI, a
    forecast, a job prediction and an unmodified script under auto mode, from another directory."""
    python = fresh_venv(tmp_path / "venv", with_torch=True)
    env = clean_env()
    for words in readme_install_commands():
        assert words[0] == "pip", words
        out = subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *words[1:]], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=1800)
        assert out.returncode == 0, f"{words}: {out.stdout[-2000:]}{out.stderr[-3000:]}"
        if "--no-build-isolation" in words:  # -v shows the build's progress, step by step (and each compile, if any)
            said = out.stdout + out.stderr  # pip relays the backend's output on either stream
            assert re.findall(r"\*\*\* (Configuring CMake|Building project|Making wheel)", said) == [
                "Configuring CMake", "Building project", "Making wheel"], said[-3000:]
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    assert (site / "gpucast" / "lib" / "libgpucast.so").is_file()
    assert (site / "gpucast" / "_build_info.py").is_file()
    assert (site / "gpucast" / "data" / "job_memory.gcw").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def run(*args, timeout=600):
        r = subprocess.run([str(python), *args], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, r.stderr[-3000:]
        return r
    assert "H100-80GB" in run("-m", "gpucast", "devices").stdout
    assert run("-c", FORECAST).stdout.split() == ["H100-80GB", "True", str(site / "gpucast" / "lib" / "libgpucast.so")]
    # The installed package answers job-level predictions with its shipped weights.
    job = elsewhere / "job.json"
    job.write_text(json.dumps({"schema_version": 1, "family": "mlp", "batch_size": 8, "layers": [
        {"kind": "linear", "dims": [16, 32], "params": 544, "activation_bytes_per_sample": 64}]}))
    assert run("-m", "gpucast", "predict-job", str(job)).stdout.splitlines()[0].endswith("MiB per rank (learned)")
    # The example finds gpucast installed (no source-tree fallback needed) and runs with auto mode on.
    r = run("-m", "gpucast", "run", "--target", "A100-80GB", "--", str(ROOT / "examples" / "gpt.py"), "--no-trace",
            "--steps", "2")
    assert "gpucast forecast for A100-80GB, batch 8:" in r.stderr
