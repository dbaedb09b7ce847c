"""The public classes are named as users import them (gpucast.X), in tracebacks, reprs and pickles."""
import inspect
import pickle
import subprocess
import sys
from pathlib import Path

import gpucast

ROOT = Path(__file__).resolve().parents[2]


def test_every_public_class_is_gpucasts():
    classes = {n: getattr(gpucast, n) for n in gpucast.__all__ if inspect.isclass(getattr(gpucast, n))}
    assert sorted(classes) == ["Forecast", "MemoryForecast", "OutOfMemoryRisk", "OutOfMemoryRiskWarning", "Trace", "trace"]
    assert {n: c.__module__ for n, c in classes.items()} == {n: "gpucast" for n in classes}


def test_the_raised_risk_names_the_public_class():
    code = "import gpucast\nraise gpucast.OutOfMemoryRisk('gpucast: out-of-memory risk on cpu')\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT / "python"), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == "gpucast.OutOfMemoryRisk: gpucast: out-of-memory risk on cpu"


def test_a_pickled_risk_comes_back():
    e = pickle.loads(pickle.dumps(gpucast.OutOfMemoryRisk("x")))
    assert type(e) is gpucast.OutOfMemoryRisk and str(e) == "x"
