"""Bad input: errors name the option or path, what was expected and what was given."""
import json

import pytest
import torch

import gpucast


def test_unknown_option():
    with pytest.raises(ValueError, match=r"unknown option 'record_shape'; valid options: record_shapes, memory"):
        gpucast.trace(record_shape=True)


def test_wrong_types():
    with pytest.raises(ValueError, match=r"option 'max_ops' expects a positive integer, got 'abc'"):
        gpucast.trace(max_ops="abc")
    with pytest.raises(ValueError, match=r"option 'memory' expects True or False, got 'maybe'"):
        gpucast.trace(memory="maybe")
    with pytest.raises(ValueError, match=r"option 'max_events' expects a positive integer, got '-5'"):
        gpucast.trace(max_events=-5)


def test_unwritable_output_paths(tmp_path):
    with gpucast.trace() as t:
        pass
    with pytest.raises(ValueError, match=r"cannot write '/nonexistent-dir/t.json': No such file or directory"):
        t.save("/nonexistent-dir/t.json")
    with pytest.raises(ValueError, match=r"cannot write '/nonexistent-dir/t.perfetto.json'"):
        t.save_chrome("/nonexistent-dir/t.perfetto.json")


def test_bad_trace_files(tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(ValueError, match=f"cannot read '{missing}': No such file or directory"):
        gpucast.load_trace(str(missing))
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1, "ops": [')
    with pytest.raises(ValueError, match=rf"{bad}: malformed JSON at byte 31: "):
        gpucast.load_trace(str(bad))
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"schema_version": 99}))
    with pytest.raises(ValueError, match=r"trace schema_version 99 is not supported by this gpucast \(reads versions 1 to 3\)"):
        gpucast.load_trace(str(old))


def test_results_before_the_trace_ends():
    t = gpucast.trace()
    with pytest.raises(RuntimeError, match="the trace is still running"):
        t.summary()


def test_a_bad_parallel_configuration_is_said_before_the_probes_run():
    calls = []

    def step(batch):
        calls.append(batch)

    for parallel, message in ((dict(dp=0), "parallel: option 'dp' expects a positive integer, got '0'"),
                              (dict(tp="two"), "parallel: option 'tp' expects a positive integer, got 'two'"),
                              (dict(dp_mode="zero3"),
                               "parallel: option 'dp_mode' expects one of ddp|zero1|zero2|fsdp, got 'zero3'")):
        with pytest.raises(ValueError) as e:
            gpucast.forecast(step, lambda n: n, 32, parallel=parallel)
        assert str(e.value) == "[gpucast:parallel] " + message
    # FSDP2's reshard_after_forward: True, False or a number of ranks dividing dp.
    with pytest.raises(ValueError) as e:
        gpucast.forecast(step, lambda n: n, 32, parallel=dict(dp=4, dp_mode="fsdp", reshard_after_forward=3))
    assert str(e.value) == ("[gpucast:parallel] parallel: option 'reshard_after_forward' expects True, False or a "
                            "number of ranks that divides dp (4), got '3'")
    # A dp that does not divide the batch: the ranks would hold different batches.
    with pytest.raises(ValueError) as e:
        gpucast.forecast(step, lambda n: n, 30, parallel=dict(dp=4))
    assert str(e.value).startswith("forecast: parallel dp=4 x micro_batches=1 does not divide batch_size 30:")
    # FSDP's units: a path the model does not have, said before the probes run.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError) as e:
        gpucast.forecast(step, lambda n: n, 32, model=model,
                         parallel=dict(dp=2, dp_mode="fsdp", fsdp_units=["Sequential.0", "Sequential.9"]))
    assert str(e.value).startswith("parallel: 'fsdp_units' names 'Sequential.9', which is neither a module path")
    assert calls == []  # no probe ran
