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

# A GPT-style model from the zoo, AdamW, batch 8, with the plugin loaded by torch.ops.load_library only.
GPT_SETUP = r"""
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
"""

TRAIN = GPT_SETUP + r"""
log = os.environ.get("GPUCAST_LOG")
for i in range(1, 4):
    lines = len(open(log).read().splitlines()) if log and os.path.isfile(log) else 0
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
elif route == "direct":
    torch.ops.gpucast.start_trace()
    iteration()
    raw = torch.ops.gpucast.stop_trace()
    by = {{}}
    for a in json.loads(raw.records_json("allocations", 0, raw.num_allocations())):
        if a["alloc_event"] >= 0:
            by[a["category"]] = by.get(a["category"], 0) + a["block_bytes"]
    print(json.dumps(by))
else:
    iteration()
    print(json.dumps(json.loads(torch.ops.gpucast.auto_status())["traced"]["allocated_by_category"]))
"""


@pytest.mark.parametrize("case", ["mlp", "cnn", "lstm", "gpt"])
def test_categories_from_autograd_equal_the_python_hooks(tmp_path, case):
    """Auto mode's and a direct start_trace's categories (autograd's metadata) equal gpucast.trace()'s (hooks)."""
    text = CATEGORIES.format(root=str(ROOT), python=str(ROOT / "python"), lib=LIB, case=case)
    script = tmp_path / "categories.py"
    script.write_text(text)
    got = {}
    for route, conf in (("trace", None), ("auto", "enabled:True,target:cpu"), ("direct", None)):
        env = {k: v for k, v in os.environ.items() if k not in ("GPUCAST_CONF", "GPUCAST_LOG")}
        if conf:
            env["GPUCAST_CONF"] = conf
        out = subprocess.run([sys.executable, str(script), route], env=env, capture_output=True, text=True,
                             timeout=300, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        got[route] = json.loads(out.stdout.splitlines()[-1])
    assert got["auto"] == got["trace"]
    # A trace started with torch.ops.gpucast.start_trace directly: the same categories from autograd.
    assert got["direct"] == got["trace"]
    assert got["auto"]["optimizer_state"] > 0 and got["auto"]["gradient"] > 0


# --- Bad input and faults -----------------------------------------------------------------------------------------

def test_a_fifo_log_never_blocks_training(tmp_path):
    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)  # no reader: opening it for writing would block
    out = train(tmp_path, "enabled:True,target:cpu", fifo)
    assert out.returncode == 0, out.stderr
    said = f"gpucast: GPUCAST_LOG='{fifo}' cannot be written (not a regular file (gpucast appends logs to regular files only)): forecasts will not be logged"
    assert out.stderr.count(said) == 1
    assert marks(out.stderr)[0] == said  # when the configuration was read, before iteration 1
    assert "iteration 3 start" in out.stderr and "Warning: gpucast" not in out.stderr


def test_a_log_folder_that_does_not_exist_is_said_when_the_configuration_is_read(tmp_path):
    log = tmp_path / "missing" / "gpucast.jsonl"
    out = train(tmp_path, "enabled:True,target:cpu", log)
    assert out.returncode == 0, out.stderr
    seen = marks(out.stderr)
    assert seen[0].startswith(f"gpucast: GPUCAST_LOG='{log}' cannot be written (its folder '{log.parent}': No such file")
    assert sum("GPUCAST_LOG" in ln or "not logged" in ln for ln in out.stderr.splitlines()) == 1


@pytest.mark.parametrize("conf", [None, "enabled:False,target:cpu"])
def test_a_log_without_auto_mode_is_said_once(tmp_path, conf):
    """GPUCAST_LOG receives auto mode's forecasts only: set without it, one line says so, before training."""
    log = tmp_path / "gpucast.jsonl"
    out = train(tmp_path, conf, log)
    assert out.returncode == 0, out.stderr
    said = [ln for ln in out.stderr.splitlines() if "GPUCAST_LOG" in ln]
    assert said == [f"gpucast: GPUCAST_LOG='{log}' is set but auto mode is off when the library loads (GPUCAST_CONF "
                    "has no enabled:True): only auto mode's forecasts are logged there"]
    assert marks(out.stderr)[0] == said[0] and not log.exists()


def test_a_log_with_auto_mode_says_nothing_of_it(tmp_path):
    out = train(tmp_path, "enabled:True,target:cpu", tmp_path / "gpucast.jsonl")
    assert out.returncode == 0, out.stderr
    assert "GPUCAST_LOG" not in out.stderr


LOAD_ONLY = r"""
import sys
import torch
torch.ops.load_library({lib!r})
for name in sys.argv[1:]:
    try:
        getattr(torch.ops.gpucast, name)("")
        print(f"{{name}}: ok", file=sys.stderr)
    except ValueError as e:
        print(f"{{name}}: ValueError: {{e}}", file=sys.stderr)
print("state " + __import__("json").loads(torch.ops.gpucast.auto_status())["state"], file=sys.stderr)
"""


def load_only(tmp_path, conf, *ops, lib=LIB):
    script = tmp_path / "load.py"
    script.write_text(LOAD_ONLY.format(lib=lib))
    env = {k: v for k, v in os.environ.items() if k not in ("GPUCAST_CONF", "GPUCAST_LOG")}
    env["GPUCAST_CONF"] = conf
    return subprocess.run([sys.executable, str(script), *ops], env=env, capture_output=True, text=True, timeout=120)


def test_a_malformed_configuration_never_fails_the_load(tmp_path):
    out = load_only(tmp_path, "enabled:True,warn_fraction:2", "check_trace_options", "check_trace_options")
    assert out.returncode == 0, out.stderr
    said = "[gpucast:auto-config] GPUCAST_CONF: option 'warn_fraction' expects a number in [0.01, 1], got '2'"
    assert out.stderr.splitlines() == [f"gpucast: auto mode is off: {said}",
                                       f"check_trace_options: ValueError: {said}",  # the first op, once
                                       "check_trace_options: ok", "state off"]


@pytest.mark.parametrize("conf,expected", [
    ("enabled:True,capacity_mb:9223372036854775807", "option 'capacity_mb' expects at most 16777216"),
    ("enabled:True,warn_fraction:1e-300", "option 'warn_fraction' expects a number in [0.01, 1], got '1e-300'"),
    ("enabled:True,target:H100", "option 'target' expects auto, cpu or a device table name (cpu, A100-40GB, "
                                 "A100-80GB, H100-80GB, H200-141GB, L4, V100-32GB, RTX-4090), or any name with "
                                 "capacity_mb, got 'H100'"),
    ("enabled:True,max_iteration_s:0", "option 'max_iteration_s' expects a positive integer"),
])
def test_configuration_out_of_range_is_refused_when_read(tmp_path, conf, expected):
    out = load_only(tmp_path, conf)
    assert expected in out.stderr.splitlines()[0] and out.stderr.splitlines()[-1] == "state off"


def test_a_capacity_makes_any_target_name_usable(tmp_path):
    log = tmp_path / "gpucast.jsonl"
    out = train(tmp_path, "enabled:True,target:MyAccelerator,capacity_mb:4096", log)
    assert out.returncode == 0, out.stderr
    (rec,) = records(log)
    assert rec["memory"]["target"] == "MyAccelerator" and rec["memory"]["capacity_bytes"] == 4096 * 2**20
    assert rec["fits"] is True and [n["code"] for n in rec["memory"]["notes"]].count("unknown-device") == 1


def test_a_second_copy_of_the_library_is_refused_with_both_paths(tmp_path):
    copy = tmp_path / "libgpucast-copy.so"
    shutil.copy(LIB, copy)
    script = tmp_path / "two.py"
    script.write_text(f"import torch, sys\ntorch.ops.load_library({LIB!r})\ntorch.ops.load_library({str(copy)!r})\n"
                      "print(torch.ops.gpucast.library_path(), file=sys.stderr)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "GPUCAST_CONF"})
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [
        f"gpucast: this copy of the library ({copy}) was not loaded: another copy is loaded from "
        f"{LIB}; the ops are that copy's. Load one copy per process (GPUCAST_LIBRARY names which).", LIB]


WORKERS = r"""
import json, sys
import torch
torch.ops.load_library({lib!r})
from torch.utils.data import DataLoader, Dataset

class Transform(torch.nn.Module):  # a learned transform: it has parameters and runs with grad mode on
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Linear(4, 4)
    def forward(self, x):
        return self.scale(x)

class Data(Dataset):
    def __init__(self):
        self.t = Transform()
    def __len__(self):
        return 4
    def __getitem__(self, i):
        for _ in range(300):
            self.t(torch.ones(4))
        s = json.loads(torch.ops.gpucast.auto_status())
        return json.dumps({{"state": s["state"], "tracing": torch.ops.gpucast.is_tracing(),
                            "notes": [n["code"] for n in s["notes"]]}})

if __name__ == "__main__":
    loader = DataLoader(Data(), batch_size=None, num_workers=1, multiprocessing_context=sys.argv[1])
    for item in loader:
        print(item)
"""


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_data_loading_worker_never_traces_for_long(tmp_path, context):
    script = tmp_path / "workers.py"
    script.write_text(WORKERS.format(lib=LIB))
    env = {k: v for k, v in os.environ.items() if k not in ("GPUCAST_CONF", "GPUCAST_LOG")}
    env["GPUCAST_CONF"] = "enabled:True,target:cpu,max_iteration_ops:500"
    out = subprocess.run([sys.executable, str(script), context], env=env, capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    items = [json.loads(x) for x in out.stdout.splitlines()]
    assert len(items) == 4 and not any(i["tracing"] for i in items)
    if context == "fork":  # a forked child is not the process that trains: off from the fork on
        assert all(i["state"] == "off" and i["notes"] == [] for i in items)
    else:  # a spawned worker loads the library afresh: its trace stops itself at the bound, with one note
        assert all(i["state"] == "done" and i["notes"] == ["no-iteration-end"] for i in items)
        assert out.stderr.count("gpucast: auto mode: the first iteration did not end within 500 ops") == 1


INTERRUPTED = GPT_SETUP + r"""
bad = torch.ones(3, 5)
for i in range(4):
    try:
        opt.zero_grad(set_to_none=True)
        h = model.tok_emb(x)
        if i == 0:
            h @ bad  # an op that raises in the forward: the loop catches it and goes on
        loss = case.loss_fn(model(x), y)
        loss.backward()
        opt.step()
    except RuntimeError:
        del h
        torch.ops.gpucast.cpu_memory_stats(True)
print(json.dumps({{"peak": torch.ops.gpucast.cpu_memory_stats(False)[1], "status": json.loads(torch.ops.gpucast.auto_status())}}))
"""


THREADS = r"""
import json, sys, threading
import torch
torch.ops.load_library({lib!r})
sys.path[:0] = [{root!r}]
from examples import zoo
torch.set_num_threads(1)
barrier = threading.Barrier(2)

def train(seed):
    torch.manual_seed(seed)
    case = zoo.CASES["mlp"]
    model = case.make_model()
    opt = torch.optim.AdamW(model.parameters())
    x, y = case.make_batch(64)
    for i in range(3):
        opt.zero_grad(set_to_none=True)
        if i == 0:
            barrier.wait()
        for _ in range(20):
            loss = case.loss_fn(model(x), y)
        loss.backward()
        opt.step()

threads = [threading.Thread(target=train, args=(s,)) for s in (0, 1)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(torch.ops.gpucast.auto_status())
"""


def test_two_models_trained_at_once_are_refused_with_a_note(tmp_path):
    log = tmp_path / "gpucast.jsonl"
    out = run_script(tmp_path, THREADS.format(lib=LIB, root=str(ROOT)), "enabled:True,target:cpu", log)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout.splitlines()[-1])
    assert status["state"] == "done" and [n["code"] for n in status["notes"]] == ["concurrent-iterations"]
    assert not log.exists() and out.stderr.count("another thread ran a forward pass") == 1


# --- The examples -------------------------------------------------------------------------------------------------

EXAMPLE_CPP = ROOT / "build" / "bin" / "gpucast-example-train"


def run_example(tmp_path, command, conf, log):
    env = {k: v for k, v in os.environ.items() if k not in ("GPUCAST_CONF", "GPUCAST_LOG")}
    env.update(GPUCAST_CONF=conf, GPUCAST_LOG=str(log))
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)


@pytest.mark.parametrize("example", ["cpp", "python"])
def test_the_examples_warn_fit_and_raise(tmp_path, example):
    if example == "cpp" and not EXAMPLE_CPP.is_file():
        pytest.skip("the C++ example is not built (a build without its target)")
    command = [str(EXAMPLE_CPP)] if example == "cpp" else [sys.executable, str(ROOT / "examples" / "load_library.py")]
    log = tmp_path / "warn.jsonl"
    out = run_example(tmp_path, command, "enabled:True,target:cpu,capacity_mb:2", log)
    assert out.returncode == 0, out.stderr
    seen = marks(out.stderr)
    assert seen[0] == "iteration 1 start" and "Warning: gpucast: out-of-memory risk on cpu" in seen[1]
    assert seen[2:] == ["iteration 2 start", "iteration 3 start", "done"]
    assert [r["fits"] for r in records(log)] == [False]

    log = tmp_path / "fits.jsonl"
    out = run_example(tmp_path, command, "enabled:True,target:H100-80GB,verbose:True", log)
    assert out.returncode == 0, out.stderr
    assert marks(out.stderr)[1].startswith("gpucast: fits: peak reserved ")
    (rec,) = records(log)
    assert rec["fits"] is True and rec["memory"]["batch_size"] == 64

    log = tmp_path / "raise.jsonl"
    out = run_example(tmp_path, command, "enabled:True,target:H100-80GB,capacity_mb:600,on_risk:raise", log)
    assert "iteration 2 start" in out.stderr and "iteration 3 start" not in out.stderr
    assert "gpucast: out-of-memory risk on H100-80GB" in out.stderr
    assert out.returncode != 0 and [r["fits"] for r in records(log)] == [False]


SIGINT = GPT_SETUP + r"""
import signal
# Python raises KeyboardInterrupt only where SIGINT was not ignored when it started, and a shell starts background
# jobs with SIGINT ignored (a test run under `make ... &`): the script sets Python's handler itself.
signal.signal(signal.SIGINT, signal.default_int_handler)
for i in range(4):
    try:
        opt.zero_grad(set_to_none=True)
        h = model.tok_emb(x)
        if i == 0:
            # Ctrl-C during iteration 1's forward, raised between ops. raise_signal delivers it to this thread before
            # it returns; os.kill let the kernel pick any thread, and on a busy host the handler ran an iteration late.
            signal.raise_signal(signal.SIGINT)
            sum(range(10000))
        loss = case.loss_fn(model(x), y)
        loss.backward()
        opt.step()
    except KeyboardInterrupt:
        del h
        torch.save(model.state_dict(), "checkpoint.pt")  # the loop saves a checkpoint and trains on
        torch.ops.gpucast.cpu_memory_stats(True)
print(json.dumps({{"peak": torch.ops.gpucast.cpu_memory_stats(False)[1], "status": json.loads(torch.ops.gpucast.auto_status())}}))
"""


@pytest.mark.parametrize("how", ["op-error", "sigint"])
def test_an_interrupted_first_iteration_is_not_forecast_from(tmp_path, how):
    # op-error: an op raises in iteration 1's forward (C++ unwinding through its record); sigint: Ctrl-C raised
    # between ops, caught, a checkpoint saved (the next zero_grad restarts the iteration).
    log = tmp_path / "gpucast.jsonl"
    script = {"op-error": INTERRUPTED, "sigint": SIGINT}[how]
    out = run_script(tmp_path, script.format(lib=LIB, root=str(ROOT)), "enabled:True,target:cpu", log)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.splitlines()[-1])
    (rec,) = records(log)
    assert [n["code"] for n in rec["notes"]] == ["interrupted-iteration"]
    # The next complete iteration was forecast from: its peak is the run's after the interruption, to the byte,
    # gradients included (the iteration's backward was traced).
    assert rec["memory"]["peak_allocated_bytes"] == r["peak"]
    assert r["status"]["traced"]["allocated_by_category"]["gradient"] > 0


def test_a_forecast_that_cannot_be_made_is_one_warning_and_training_goes_on(tmp_path):
    log = tmp_path / "gpucast.jsonl"
    out = train(tmp_path, "enabled:True,target:H100-80GB", log, env={"PYTORCH_ALLOC_CONF": "max_split_size_mb:lots"})
    assert out.returncode == 0, out.stderr
    seen = marks(out.stderr)
    assert seen[0] == "iteration 1 start, log lines 0"
    assert "Warning: gpucast: auto mode stopped, no forecast: [gpucast:allocator-config]" in seen[1]
    assert seen[2:] == ["iteration 2 start, log lines 0", "iteration 3 start, log lines 0", "done"]
    assert not log.exists()
