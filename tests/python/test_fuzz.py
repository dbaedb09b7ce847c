"""Fuzzing that stays: every parser survives its corpus, the inputs of every known fault, every crash the fuzzer
saved, and a bounded seeded run of mutations (tests/fuzz/run.py; `make fuzz` runs longer).

A fault is a crash (signal), a hang, an exception other than ValueError (UnicodeDecodeError, TypeError,
RuntimeError, a raw nlohmann message), a non-finite or non-positive answer, or a GPU rates file that stops the
forecast. A failure lists each fault's kind and the saved input, with the command that replays it.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "fuzz"))
from targets import TARGETS  # noqa: E402

SEED = 20261206
ITERATIONS = 40  # per target: all ten together, corpus and known inputs included, take well under a minute here
OUT = ROOT / "build" / "fuzz" / "ci"


@pytest.fixture(scope="module")
def fuzz_summary():
    OUT.mkdir(parents=True, exist_ok=True)
    summary = OUT / "summary.json"
    summary.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), str(ROOT)]))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "fuzz" / "run.py"), "--seed", str(SEED),
                           "--iterations", str(ITERATIONS), "--known", "--crashes", "--timeout", "20", "--quiet",
                           "--out", str(OUT), "--json", str(summary)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if not summary.is_file():
        pytest.fail(f"the fuzz runner failed (status {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(summary.read_text())


@pytest.mark.parametrize("target", list(TARGETS))
def test_no_faults(fuzz_summary, target):
    stats = fuzz_summary["targets"][target]
    assert stats["corpus"] > 0 and stats["mutations"] == ITERATIONS
    faults = [f for f in fuzz_summary["faults"] if f["target"] == target]
    lines = [f"{len(faults)} faults in {stats['tried']} inputs of target {target} "
             f"(library {fuzz_summary['library'] or 'default'}):"]
    for f in faults:
        lines.append(f"  {f['kind']} ({f['origin']}): {f['input']}")
        lines.append(f"      {f['detail'].splitlines()[0][:240] if f['detail'] else ''}")
        lines.append(f"      replay: PYTHONPATH=python:. .venv/bin/python tests/fuzz/run.py --target {target} "
                     f"--input {f['input']}")
    assert not faults, "\n".join(lines)
