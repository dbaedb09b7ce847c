"""The fault matrix: each fault found by the fault and bad-input probe of gpucast (issue: safe to leave on inside a
training job), with what must happen now. Crashes and raw library errors became ValueErrors with a code and the
field; silent wrong answers became refusals or the analytical estimate with a note; lost data became atomic writes
and torn-line-safe appends. (tests/python/test_fuzz.py runs the same inputs, and mutations of real files, through
every parser.)"""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import gpucast
from gpucast._errors import error_code
from gpucast._jsonl import append_record, read_records

ROOT = Path(__file__).resolve().parents[2]
FUZZ = ROOT / "tests" / "data" / "fuzz"


def _text(path: Path) -> str:
    data = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    return data.decode("utf-8", errors="surrogateescape")


def _small_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch):
        opt.zero_grad()
        model(batch).sum().backward()
        opt.step()
    return model, opt, step


# --- Memory-unsafe C++ on input a user can produce ---------------------------------------------------------------

def test_a_roundup_power2_divisions_list_is_read_safely(monkeypatch):
    # It was read through a view of a dead temporary: a use-after-free (garbage or a UnicodeDecodeError).
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", (FUZZ / "alloc_conf/known/roundup_power2_divisions_list.txt")
                       .read_text().strip())
    model, opt, step = _small_step()
    runs = [gpucast.forecast(step, lambda n: torch.randn(n, 8), 64, model=model, optimizer=opt, target="H100-80GB",
                             probe_batch_sizes=(2, 4, 8)).memory for _ in range(2)]
    assert runs[0].peak_reserved_bytes == runs[1].peak_reserved_bytes > 0


@pytest.mark.parametrize("name,field", [
    ("alloc_op_out_of_range.json", r"allocations\[\d+\]\.alloc_op"),
    ("event_allocation_out_of_range.json", r"events\[\d+\]\.allocation"),
])
def test_an_index_out_of_range_is_named(name, field):
    with pytest.raises(ValueError, match=rf"field '{field}' should be -1 or an index below \d+") as e:
        gpucast.load_trace(str(FUZZ / "trace/known" / name))
    assert error_code(e.value) == "trace-file"


@pytest.mark.parametrize("path,code", [("trace/known/ops_nested_100000.json", "trace-file"),
                                       ("job/known/layers_nested_100000.json", "job-file")])
def test_deep_nesting_is_refused_before_parsing(path, code):
    text = _text(FUZZ / path)
    with pytest.raises(ValueError) as e:
        if code == "trace-file":
            torch.ops.gpucast.trace_from_json(text)
        else:
            torch.ops.gpucast.validate_job(text)
    assert error_code(e.value) == code and "nested more than 64 levels deep" in str(e.value)


# --- Silent wrong answers ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["head_bias_3e38.gcw", "job_std_zero.gcw"])
def test_a_broken_job_model_gives_the_analytical_estimate_with_a_note(name):
    job = FUZZ / "job/dataset_mlp.json"
    out = gpucast.predict_job(str(job), weights=str(FUZZ / "job_weights/known" / name))
    analytical = gpucast.predict_job(str(job), weights="/nonexistent.gcw")
    assert out["method"] == "analytical" and out["bytes"] == analytical["bytes"] > 0
    assert out["notes"][0]["code"] == "learned-unavailable" and "weights file" in out["notes"][0]["text"]


@pytest.mark.parametrize("shift", [8.0, -8.0])
def test_an_implausible_learned_answer_gives_the_analytical_estimate_with_a_note(tmp_path, shift):
    # Finite weights within the trainer's range whose answer is exp(+-8) (about 2981x or 1/2981x) the analytical
    # estimate: outside half the smallest to twice the largest ratio the training set held, taken for a broken model.
    sys.path.insert(0, str(ROOT / "tests" / "fuzz"))
    import mutate
    w = mutate.parse_weights(Path(torch.ops.gpucast.job_weights_path()).read_bytes())
    bias = next(t for t in w["tensors"] if t[0] == b"head2.bias")
    assert len(bias[2]) == 2  # the head's outputs: the log of the correction, and reserved's gap above it
    bias[2][0] += shift
    path = tmp_path / "shifted.gcw"
    path.write_bytes(mutate.build_weights(w))
    job = FUZZ / "job/dataset_mlp.json"
    out = gpucast.predict_job(str(job), weights=str(path))
    analytical = gpucast.predict_job(str(job), weights="/nonexistent.gcw")
    assert out["method"] == "analytical" and out["bytes"] == analytical["bytes"] > 0
    assert out["notes"][0]["code"] == "learned-implausible"
    assert gpucast.predict_job(str(job))["method"] == "learned"  # the shipped weights answer this job


@pytest.mark.parametrize("name", ["head_bias_3e38.gcw", "node_std_zero.gcw"])
def test_a_broken_graph_network_gives_no_correction(name):
    graph = next((FUZZ / "step_graph").glob("*.json")).read_text()
    out = json.loads(torch.ops.gpucast.step_correction(graph, str(FUZZ / "step_gnn_weights/known" / name)))
    assert (out["alpha"], out["beta"]) == (1.0, 1.0)
    assert out["source"].startswith("none: weights file")


@pytest.mark.parametrize("name", ["schema_version_4294967297.json", "schema_version_uint64_max.json"])
def test_a_version_is_never_read_modulo_2_to_the_32(name):
    with pytest.raises(ValueError) as e:
        gpucast.predict_job(str(FUZZ / "job/known" / name))
    assert error_code(e.value) == "job-file"


def test_a_job_whose_sizes_overflow_is_refused():
    with pytest.raises(ValueError) as e:
        gpucast.predict_job(str(FUZZ / "job/crashes/negative_activation_bytes.json"))
    assert error_code(e.value) == "job-file" and "overflows a 64-bit count" in str(e.value)


def test_a_capped_trace_makes_a_lower_bound_said_aloud():
    model, opt, step = _small_step()
    f = torch.classes.gpucast.MemoryForecaster()
    for b in (2, 4, 8):
        with gpucast.trace(model=model, max_ops=20) as t:
            step(torch.randn(b, 8))
        assert t.result.counters["dropped_ops"] > 0
        f.add_probe(t.result.handle, b)
    out = json.loads(f.run(target_batch=16))
    assert [w["code"] for w in out["warnings"]].count("trace-capped") == 3


# --- Unclear errors ----------------------------------------------------------------------------------------------

def test_a_capacity_past_any_device_is_refused_by_the_parser():
    text = (FUZZ / "auto_config/known/capacity_mb_int64_max.txt").read_text().strip()
    with pytest.raises(ValueError) as e:
        torch.ops.gpucast.parse_auto_config(text)
    assert error_code(e.value) == "auto-config" and "expects at most 16777216" in str(e.value)


@pytest.mark.parametrize("path,code", [("trace/known/start_ns_1e400.json", "trace-file"),
                                       ("trace/known/counters_array.json", "trace-file"),
                                       ("trace/known/op_name_invalid_utf8.json", "trace-file"),
                                       ("job/known/batch_size_1e400.json", "job-file")])
def test_no_raw_library_message_reaches_the_user(path, code):
    with pytest.raises(ValueError) as e:
        if code == "trace-file":
            gpucast.load_trace(str(FUZZ / path))
        else:
            gpucast.predict_job(str(FUZZ / path))
    assert error_code(e.value) == code
    assert "[json.exception" not in str(e.value) and str(FUZZ / path) in str(e.value)


def test_a_configuration_variable_that_is_not_utf8_is_named(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", b"max_split_size_mb:\xff".decode("utf-8", "surrogateescape"))
    model, opt, step = _small_step()
    with pytest.raises(ValueError, match=r"^PYTORCH_CUDA_ALLOC_CONF: not UTF-8 at character 18"):
        gpucast.forecast(step, lambda n: torch.randn(n, 8), 16, model=model, optimizer=opt, target="H100-80GB")


# --- Lost data ---------------------------------------------------------------------------------------------------

def test_a_failed_save_keeps_the_old_trace(tmp_path):
    # A full disk, as a file-size limit: the new trace cannot be written, the old one stays whole.
    script = textwrap.dedent(f"""
        import resource, signal, sys, torch
        sys.path.insert(0, {str(ROOT / 'python')!r})
        import gpucast
        with gpucast.trace() as small:
            torch.ones(4) + 1
        small.result.save(sys.argv[1])
        with gpucast.trace() as big:
            for _ in range(2000):
                torch.ones(4) + 1
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        try:
            big.result.save(sys.argv[1])
        except ValueError as e:
            print(str(e))
    """)
    path = tmp_path / "t.json"
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"[gpucast:file-write] cannot write '{path}': File too large; the file there")
    assert len(gpucast.load_trace(str(path)).ops) >= 1  # the old trace, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]  # no temporary file left


def test_an_append_after_a_torn_line_starts_a_new_line(tmp_path):
    log = tmp_path / "forecasts.jsonl"
    log.write_text('{"kind": "forecast", "a": 1}\n{"kind": "forecast", "a"')  # a write cut short
    append_record(str(log), {"kind": "forecast", "a": 2})
    assert log.read_text().splitlines()[-1] == '{"kind": "forecast", "a": 2}'
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        records = list(read_records(str(log)))
    assert [r["a"] for r in records] == [1, 2]
    assert len(w) == 1 and "skipped 1 line(s)" in str(w[0].message) and "line 2" in str(w[0].message)


def test_a_log_path_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        append_record(str(fifo), {"a": 1})  # opening a FIFO for writing would block until a reader came


# --- Bounded memory ----------------------------------------------------------------------------------------------

def test_views_of_a_trace_are_lazy():
    with gpucast.trace() as t:
        for _ in range(10):
            torch.ones(4) + 1
    ops = t.result.ops
    assert type(ops).__name__ == "_Records" and len(ops) == t.result.handle.num_ops()
    assert [o.id for o in ops] == list(range(len(ops))) and ops[-1].id == len(ops) - 1
    assert t.result.counters["dropped_ops"] == 0  # from the header, not the whole document
