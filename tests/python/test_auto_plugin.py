"""Auto mode inside the plugin: torch.ops.load_library and GPUCAST_CONF, with no `import gpucast`; each run in a fresh
process. The same forecast through `import gpucast`, equal to the measured peak of the run."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIB = os.environ.get("GPUCAST_LIBRARY") or str(ROOT / "build" / "lib" / "libgpucast.so")
GOLDEN = json.loads((ROOT / "tests" / "data" / "auto" / "python_auto_golden.json").read_text())["cases"]

TRAIN = r"""
import json, os, sys
import torch
torch.ops.load_library({lib!r})
sys.path[:0] = [{root!r}]
from examples import zoo
torch.set_num_threads(1)
torch.manual_seed(0)
case = zoo.CASES["gpt"]
model = case.make_model()
opt = torch.optim.AdamW(model.parameters())
x, y = case.make_batch(8)
log = os.environ.get("GPUCAST_LOG")
for i in range(1, 4):
    lines = len(open(log).read().splitlines()) if log and os.path.exists(log) else 0
    print(f"iteration {{i}} start, log lines {{lines}}", file=sys.stderr, flush=True)
    try:
        opt.zero_grad(set_to_none=True)
        loss = case.loss_fn(model(x), y)
        loss.backward()
        opt.step()
    except RuntimeError as e:
        print(f"raised in iteration {{i}}: out-of-memory error type {{isinstance(e, torch.OutOfMemoryError)}}",
              file=sys.stderr)
        print(str(e).splitlines()[0], file=sys.stderr)
        break
print("done", file=sys.stderr)
"""


def run_script(tmp_path, text, conf, log=None, env=None, timeout=300):
    script = tmp_path / "train.py"
    script.write_text(text)
    e = dict(os.environ, PYTHONWARNINGS="default")
    for k in ("GPUCAST_LOG", "GPUCAST_CONF", "RANK", "WORLD_SIZE"):
        e.pop(k, None)
    if conf is not None:
        e["GPUCAST_CONF"] = conf
    if log is not None:
        e["GPUCAST_LOG"] = str(log)
    e.update(env or {})
    return subprocess.run([sys.executable, str(script)], env=e, capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path)


def train(tmp_path, conf, log=None, env=None):
    return run_script(tmp_path, TRAIN.format(lib=LIB, root=str(ROOT)), conf, log, env)


def marks(stderr):
    return [ln for ln in stderr.splitlines() if ln.startswith(("iteration", "raised", "done", "gpucast:"))
            or "Warning: gpucast:" in ln]


def records(log):
    return [json.loads(x) for x in log.read_text().splitlines()]


def test_load_library_warns_once_before_iteration_two(tmp_path):
    log = tmp_path / "gpucast.jsonl"
    out = train(tmp_path, "enabled:True,target:cpu,capacity_mb:16", log)
    assert out.returncode == 0, out.stderr
    seen = marks(out.stderr)
    assert seen[0] == "iteration 1 start, log lines 0"
    # Through c10's warning handler: the step scope ends in torch.optim's code, outside any Python binding's
    # warning handler, so c10 prints it ("[W... auto_mode.cpp:N] Warning: gpucast: ...").
    assert "] Warning: gpucast: out-of-memory risk on cpu: the run needs" in seen[1]
    assert seen[2:] == ["iteration 2 start, log lines 1", "iteration 3 start, log lines 1", "done"]
    assert out.stderr.count("out-of-memory risk") == 1
    (rec,) = records(log)
    assert rec["mode"] == "auto" and rec["fits"] is False and rec["memory"]["target"] == "cpu"
    assert rec["capacity_fraction"] == rec["memory"]["peak_reserved_bytes"] / (16 * 2**20)
    assert "rank" not in rec and "world_size" not in rec


def test_load_library_fits_logs_fits_and_says_so_with_verbose(tmp_path):
    log = tmp_path / "gpucast.jsonl"
    out = train(tmp_path, "enabled:True,target:H100-80GB,verbose:True", log, env={"RANK": "3", "WORLD_SIZE": "8"})
    assert out.returncode == 0, out.stderr
    assert "out-of-memory risk" not in out.stderr
    (line,) = [ln for ln in out.stderr.splitlines() if ln.startswith("gpucast: fits:")]
    assert line.endswith("on H100-80GB; largest batch " + line.rsplit(" ", 1)[1])
    (rec,) = records(log)
    assert rec["fits"] is True and rec["memory"]["target"] == "H100-80GB"
    assert 0 < rec["capacity_fraction"] < 0.01
    assert rec["rank"] == 3 and rec["world_size"] == 8


def test_load_library_raise_stops_iteration_two_at_its_first_allocation(tmp_path):
    out = train(tmp_path, "enabled:True,target:H100-80GB,capacity_mb:700,on_risk:raise")
    seen = marks(out.stderr)
    assert seen[:3] == ["iteration 1 start, log lines 0", "iteration 2 start, log lines 0",
                        "raised in iteration 2: out-of-memory error type False"]
    assert seen[3].startswith("gpucast: out-of-memory risk on H100-80GB: the run needs")
    assert re.search(r"above 90% of 700 MiB; (the largest batch that fits is \d+|no batch size fits)$", seen[3])


def golden_run(tmp_path, case, route, style):
    log = tmp_path / f"{case}-{route}-{style}.jsonl"
    env = dict(os.environ, GPUCAST_CONF="enabled:True,target:cpu", GPUCAST_LOG=str(log))
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "python" / "auto_golden.py"), case, route, style,
                          str(log)], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", ["mlp", "cnn", "lstm", "gpt"])
def test_forecast_equals_the_measured_peak_through_both_routes(tmp_path, case):
    runs = {(route, style): golden_run(tmp_path, case, route, style)
            for route in ("load_library", "import") for style in ("loop", "step")}
    for (route, style), r in runs.items():
        assert r["forecast"]["peak_allocated_bytes"] == r["measured_peak"], (route, style)
        assert r["status"]["state"] == "done" and r["status"]["notes"] == []
    # Both routes run the one implementation: the same forecast, the same traced iteration.
    for style in ("loop", "step"):
        a, b = runs[("load_library", style)], runs[("import", style)]
        assert a["forecast"] == b["forecast"] and a["breakdown"] == b["breakdown"]
        assert a["status"]["traced"] == b["status"]["traced"]
    # Against Python auto mode before the move (tests/data/auto/python_auto_golden.json, the "step" loop): its
    # trace began at the model's first forward, after zero_grad, so that iteration 2's forecast held iteration 1's
    # gradients through a forward where the run had freed them, and the steady plan held iteration 1's loss (4
    # bytes) to the end of iteration 2. The difference is exactly those two.
    new, old = runs[("load_library", "step")], GOLDEN[case]
    assert new["batch"] == old["batch"]
    assert new["forecast"]["first_iteration_peak_bytes"] == old["first_iteration_peak_bytes"]
    loss_bytes = 4
    assert (old["peak_allocated_bytes"] - new["forecast"]["peak_allocated_bytes"]
            == loss_bytes + old["breakdown"].get("gradient", 0) - new["breakdown"].get("gradient", 0))


CATEGORIES = r"""
import json, sys
import torch
sys.path[:0] = [{root!r}, {python!r}]
from examples import zoo
torch.set_num_threads(1)
torch.manual_seed(0)
route = sys.argv[1]
if route == "trace":
    import gpucast
else:
    torch.ops.load_library({lib!r})
case = zoo.CASES[{case!r}]
model = case.make_model()
opt = zoo.make_optimizer("adamw", model.parameters())
x, y = case.make_batch(case.default_batch)

def iteration():
    opt.zero_grad(set_to_none=True)
    loss = case.loss_fn(model(x), y)
    loss.backward()
    opt.step()

if route == "trace":
    with gpucast.trace(model=model) as t:
        iteration()
    by = {{}}
    for a in t.allocations:
        if a.alloc_event >= 0:
            by[a.category] = by.get(a.category, 0) + a.block_bytes
    print(json.dumps(by))
else:
    iteration()
    print(json.dumps(json.loads(torch.ops.gpucast.auto_status())["traced"]["allocated_by_category"]))
"""


@pytest.mark.parametrize("case", ["mlp", "cnn", "lstm", "gpt"])
def test_categories_from_autograd_equal_the_python_hooks(tmp_path, case):
    text = CATEGORIES.format(root=str(ROOT), python=str(ROOT / "python"), lib=LIB, case=case)
    script = tmp_path / "categories.py"
    script.write_text(text)
    got = {}
    for route, conf in (("trace", None), ("auto", "enabled:True,target:cpu")):
        env = {k: v for k, v in os.environ.items() if k not in ("GPUCAST_CONF", "GPUCAST_LOG")}
        if conf:
            env["GPUCAST_CONF"] = conf
        out = subprocess.run([sys.executable, str(script), route], env=env, capture_output=True, text=True,
                             timeout=300, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        got[route] = json.loads(out.stdout.splitlines()[-1])
    assert got["auto"] == got["trace"]
    assert got["auto"]["optimizer_state"] > 0 and got["auto"]["gradient"] > 0
