"""Auto mode: GPUCAST_CONF in the environment of an unmodified training script."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys
sys.path[:0] = [{root!r}, {python!r}]
import torch
import gpucast
from examples import zoo
torch.set_num_threads(1)
case = zoo.CASES["gpt"]
model = case.make_model()
opt = zoo.make_optimizer("adamw", model.parameters())
step = zoo.make_step(model, opt, case.loss_fn)
batch = case.make_batch(8)
for i in range(1, 4):
    print(f"iteration {{i}} start", file=sys.stderr, flush=True)
    try:
        step(batch)
    except gpucast.OutOfMemoryRisk as e:
        print(f"raised in iteration {{i}}, allocated after: {{torch.ops.gpucast.is_tracing()}}", file=sys.stderr)
        print(str(e), file=sys.stderr)
        break
print("done", file=sys.stderr)
"""


def run(tmp_path, conf, log=None):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(root=str(ROOT), python=str(ROOT / "python")))
    env = dict(os.environ, GPUCAST_CONF=conf, PYTHONWARNINGS="default")
    env.pop("GPUCAST_LOG", None)
    if log:
        env["GPUCAST_LOG"] = str(log)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    return out


def lines(stderr):
    return [ln for ln in stderr.splitlines() if ln.startswith(("iteration", "raised", "done")) or "OutOfMemoryRisk" in ln]


def test_warns_once_before_iteration_two_and_logs(tmp_path):
    log = tmp_path / "gpucast.jsonl"
    log.write_text('{"previous": "record"}\n')
    out = run(tmp_path, "enabled:True,target:cpu,capacity_mb:16", log)
    assert out.returncode == 0, out.stderr
    seen = lines(out.stderr)
    assert seen[0] == "iteration 1 start"
    assert "OutOfMemoryRiskWarning: gpucast: out-of-memory risk on cpu" in seen[1]
    assert seen[2:] == ["iteration 2 start", "iteration 3 start", "done"]
    assert out.stderr.count("out-of-memory risk") == 1
    records = log.read_text().splitlines()
    assert records[0] == '{"previous": "record"}'  # appended, never truncated
    assert len(records) == 2
    rec = json.loads(records[1])
    assert rec["schema_version"] == 1 and rec["mode"] == "auto"
    assert rec["memory"]["target"] == "cpu" and rec["memory"]["peak_allocated_bytes"] > 16 * 2**20


def test_raise_stops_before_iteration_two(tmp_path):
    out = run(tmp_path, "enabled:True,target:H100-80GB,capacity_mb:100,on_risk:raise")
    seen = lines(out.stderr)
    assert seen[:2] == ["iteration 1 start", "raised in iteration 1, allocated after: False"]
    assert "out-of-memory risk on H100-80GB" in out.stderr


def test_no_warning_when_it_fits(tmp_path):
    out = run(tmp_path, "enabled:True,target:H100-80GB")
    assert out.returncode == 0, out.stderr
    assert "out-of-memory risk" not in out.stderr
    assert lines(out.stderr)[-1] == "done"


def test_malformed_configuration_names_the_key(tmp_path):
    out = run(tmp_path, "enabled:True,warn_fraction:2")
    assert out.returncode != 0
    said = "[gpucast:auto-config] GPUCAST_CONF: option 'warn_fraction' expects a number in [0.01, 1], got '2'"
    # The library said it once when it loaded (auto mode off), and `import gpucast` raises it.
    assert out.stderr.count(f"gpucast: auto mode is off: {said}") == 1
    assert f"ValueError: {said}" in out.stderr
    out = run(tmp_path, "enabld:True")
    assert ("GPUCAST_CONF: unknown option 'enabld'; valid options: enabled, target, capacity_mb, warn_fraction, "
            "on_risk, verbose, iteration_scope, max_iteration_ops, max_iteration_s") in out.stderr


TWO_OPTIMIZERS = """
import sys
sys.path[:0] = [{root!r}, {python!r}]
import torch
import gpucast
from examples import zoo
torch.set_num_threads(1)
case = zoo.CASES["gpt"]
torch.manual_seed(0)
model = case.make_model()
blocks = [p for n, p in model.named_parameters() if ".blocks." in f".{{n}}"]
rest = [p for n, p in model.named_parameters() if ".blocks." not in f".{{n}}"]
opts = [torch.optim.AdamW(blocks), torch.optim.SGD(rest, lr=0.01, momentum=0.9)][:{optimizers}]
batch = case.make_batch(8)
for i in range(1, 4):
    print(f"iteration {{i}} start", file=sys.stderr, flush=True)
    for o in opts:
        o.zero_grad(set_to_none=True)
    try:
        case.loss_fn(model(batch[0]), batch[1]).backward()
        for o in opts:
            o.step()
    except gpucast.OutOfMemoryRisk as e:
        print(f"raised in iteration {{i}}", file=sys.stderr)
        print(str(e), file=sys.stderr)
        break
    if i == 1:
        held = sum(t.untyped_storage().nbytes() for o in opts for s in o.state.values() for t in s.values()
                   if torch.is_tensor(t))
        print(f"optimizer state {{held}}", file=sys.stderr)
print("done", file=sys.stderr)
"""


def run_two(tmp_path, conf, optimizers=2, log=None):
    script = tmp_path / "train_two.py"
    script.write_text(TWO_OPTIMIZERS.format(root=str(ROOT), python=str(ROOT / "python"), optimizers=optimizers))
    env = dict(os.environ, GPUCAST_CONF=conf, PYTHONWARNINGS="default")
    env.pop("GPUCAST_LOG", None)
    if log:
        env["GPUCAST_LOG"] = str(log)
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)


def test_two_optimizers_one_after_the_other_are_one_iteration(tmp_path):
    # The first optimizer's step does not end the iteration while the second holds parameters with gradients:
    # the forecast sees both optimizers' state (before: the SGD momentum was missing, 3,172,448 bytes).
    log = tmp_path / "gpucast.jsonl"
    out = run_two(tmp_path, "enabled:True,target:cpu", log=log)
    assert out.returncode == 0, out.stderr
    held = int(next(ln for ln in out.stderr.splitlines() if ln.startswith("optimizer state ")).split()[-1])
    rec = json.loads(log.read_text().splitlines()[-1])
    assert rec["memory"]["breakdown"]["optimizer_state"] == held == 3730528


def test_parameters_no_optimizer_steps_end_the_iteration_at_the_next_forward(tmp_path):
    # AdamW only: the other parameters have gradients that no optimizer steps; the iteration ends at the next
    # forward, whose pre-hook raises before that forward runs.
    out = run_two(tmp_path, "enabled:True,target:H100-80GB,capacity_mb:100,on_risk:raise", optimizers=1)
    seen = lines(out.stderr)
    assert seen[:3] == ["iteration 1 start", "iteration 2 start", "raised in iteration 2"]
    assert "out-of-memory risk on H100-80GB" in out.stderr


def test_a_compiled_model_trains_on_in_auto_mode(tmp_path):
    script = tmp_path / "train_compiled.py"
    script.write_text(SCRIPT.format(root=str(ROOT), python=str(ROOT / "python")).replace(
        "step = zoo.make_step(model, opt, case.loss_fn)",
        "step = zoo.make_step(torch.compile(model, backend='eager'), opt, case.loss_fn)"))
    log = tmp_path / "gpucast.jsonl"
    env = dict(os.environ, GPUCAST_CONF="enabled:True,target:cpu", GPUCAST_LOG=str(log))
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert lines(out.stderr) == ["iteration 1 start", "iteration 2 start", "iteration 3 start", "done"]
    assert "auto mode stopped" not in out.stderr
    assert json.loads(log.read_text().splitlines()[-1])["memory"]["peak_allocated_bytes"] > 0
