"""Every error the plugin raises for bad input is a ValueError whose message starts with a stable code
(docs/design.md, "Errors"): the parser's own code where it has one, else the kind of input the op reads. Each op that
reads an input is called here with a bad one, and the code is asserted, not the prose."""
from __future__ import annotations

import json

import pytest
import torch

import gpucast
from gpucast._errors import error_code

GOOD_TIMING = json.dumps({"batch": 1, "wall_ns": 1.0, "optimizer_ns": 0.0, "other_ns": 0.0, "clock": "cpu",
                          "layers": []})


def _small_trace():
    with gpucast.trace() as t:
        torch.ones(64) * 2
    return t.result.handle


def _memory_forecaster(**kw):
    t = _small_trace()
    mf = torch.classes.gpucast.MemoryForecaster()
    mf.add_probe(t, 1)
    mf.add_probe(t, 2)
    return mf.run(target_batch=4, **kw)


CASES = [
    ("trace-file", lambda tmp: gpucast.load_trace(str(tmp / "missing.json"))),
    ("trace-file", lambda tmp: torch.ops.gpucast.trace_from_json('{"schema_version": 1, "ops": [')),
    ("trace-file", lambda tmp: torch.ops.gpucast.trace_from_json('{"schema_version": 99}')),
    ("file-write", lambda tmp: _small_trace().save(str(tmp / "no" / "such" / "folder" / "t.json"))),
    ("trace-options", lambda tmp: torch.ops.gpucast.check_trace_options("max_ops:-3")),
    ("auto-config", lambda tmp: torch.ops.gpucast.parse_auto_config("warn_fraction:2")),
    ("parallel", lambda tmp: torch.ops.gpucast.check_parallel("dp:0")),
    ("parallel", lambda tmp: _memory_forecaster(parallel="dp_mode:zero9")),
    ("allocator-config", lambda tmp: _memory_forecaster(target="H100-80GB", alloc_conf="max_split_size_mb:3")),
    ("link", lambda tmp: torch.ops.gpucast.forecast_step_time([GOOD_TIMING], 4, link="intra:nvlink9")),
    ("parallel", lambda tmp: torch.ops.gpucast.forecast_step_time([GOOD_TIMING], 4, parallel="pp:x")),
    ("timing", lambda tmp: torch.ops.gpucast.forecast_step_time(["{}"], 4)),
    ("timing", lambda tmp: torch.ops.gpucast.median_timing([GOOD_TIMING, "[1]"])),
    ("timing", lambda tmp: torch.ops.gpucast.timing_with_seq(GOOD_TIMING, 0)),
    ("timing", lambda tmp: torch.ops.gpucast.choose_timed_layers("nope", 0.5)),
    ("step-time", lambda tmp: torch.ops.gpucast.forecast_step_time([GOOD_TIMING], 4, output="picture")),
    ("gpu-rates", lambda tmp: torch.ops.gpucast.gpu_rates(str(tmp / "missing.json"))),
    ("job-file", lambda tmp: torch.ops.gpucast.validate_job('{"schema_version": 1, "layers": []}')),
    ("job-file", lambda tmp: torch.ops.gpucast.predict_job("[", None)),
    ("step-graph", lambda tmp: torch.ops.gpucast.step_correction("{", "")),
    ("link-bandwidth", lambda tmp: torch.ops.gpucast.fit_allreduce([1e6, 2e6, 4e6], [40.0, 30.0, 20.0], 8)),
    ("argument", lambda tmp: torch.ops.gpucast.fit_allreduce([1.0], [], 8)),
    ("argument", lambda tmp: torch.ops.gpucast.tag([1], "cpu", "no-such-category")),
    ("argument", lambda tmp: torch.ops.gpucast.measure_conv_workspaces('{"Net.conv": null}', 8, "cpu", "{}", {}, {})),
    ("argument", lambda tmp: torch.ops.gpucast.measure_conv_workspaces("{}", 0, "cpu", "{}", {}, {})),
]


@pytest.mark.parametrize("code,call", CASES, ids=[f"{c}-{i}" for i, (c, _) in enumerate(CASES)])
def test_each_op_names_the_kind_of_bad_input(tmp_path, code, call):
    with pytest.raises(ValueError) as e:
        call(tmp_path)
    assert error_code(e.value) == code, str(e.value)


def test_the_code_comes_once_and_first():
    # A parser's own code is kept where the op would add another (gpu-rates inside forecast_step_time's pricing).
    with pytest.raises(ValueError) as e:
        torch.ops.gpucast.forecast_step_time([GOOD_TIMING], 4, gpu="H100-80GB", gpu_rates="/nonexistent.json")
    assert error_code(e.value) == "gpu-rates"
    assert str(e.value).count("[gpucast:") == 1


def test_python_own_argument_checks_have_no_code():
    with pytest.raises(ValueError) as e:
        gpucast.forecast(lambda b: None, lambda n: n, 0)
    assert error_code(e.value) is None
