"""gpucast's Python warnings name the user's line (the first frame outside gpucast, torch and the training frameworks
that call gpucast's callbacks), from whatever depth inside gpucast they are raised."""
import warnings

import pytest
import torch

import gpucast
from gpucast import _jsonl


def tiny():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def make_batch(n):
        return torch.randn(n, 8), torch.randint(0, 4, (n,))

    def step(b):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(b[0]), b[1]).backward()
        opt.step()
    return model, opt, make_batch, step


def caught(fn):
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        fn()
    return [w for w in ws if "gpucast" in str(w.message) or ".jsonl" in str(w.message)]


def lines_of(ws):
    return [(w.filename, w.lineno) for w in ws]


def test_forecast_warnings_name_the_callers_line():
    model, opt, make_batch, step = tiny()
    ws = caught(lambda: gpucast.forecast(step, make_batch, 16, target="cpu", parallel=dict(dp=2),  # the line
                                         probe_batch_sizes=(2, 4), timing_rounds=1))
    line = test_forecast_warnings_name_the_callers_line.__code__.co_firstlineno + 2
    assert {"changed the model's", "no link is known"} <= {k for w in ws for k in ("changed the model's", "no link is known")
                                                           if k in str(w.message)}
    assert set(lines_of(ws)) == {(__file__, line)}


def test_step_time_warnings_name_the_callers_line():
    model, opt, make_batch, step = tiny()
    fc = gpucast.forecast(step, make_batch, 16, model=model, optimizer=opt, target="cpu", probe_batch_sizes=(2, 4),
                          timing_rounds=1)
    ws = caught(lambda: fc.step_time(32, parallel=dict(dp=2)))
    line = test_step_time_warnings_name_the_callers_line.__code__.co_firstlineno + 4
    assert ws and set(lines_of(ws)) == {(__file__, line)}


def test_a_warning_under_a_framework_names_the_users_call(tmp_path):
    """Frames of Lightning, Hugging Face and torch between gpucast and the user are skipped."""
    log = tmp_path / "torn.jsonl"
    log.write_text('{"a": 1}\n{"b": \n')
    framework = {"__name__": "transformers.trainer", "_jsonl": _jsonl}
    exec("def fit(path):\n    return list(_jsonl.read_records(path))\n", framework)
    ws = caught(lambda: framework["fit"](str(log)))  # the user's line
    line = test_a_warning_under_a_framework_names_the_users_call.__code__.co_firstlineno + 6
    assert len(ws) == 1 and "skipped 1 line(s)" in str(ws[0].message)
    assert lines_of(ws) == [(__file__, line)]


@pytest.mark.parametrize("depth", [1, 5])
def test_user_stacklevel_counts_gpucasts_frames(depth):
    from gpucast import _warnings
    inner = {"__name__": "gpucast._fake", "_warnings": _warnings}
    exec("def f(n):\n    return f(n - 1) if n > 1 else _warnings.warn('gpucast: deep')\n", inner)
    ws = caught(lambda: inner["f"](depth))  # here
    assert lines_of(ws) == [(__file__, test_user_stacklevel_counts_gpucasts_frames.__code__.co_firstlineno + 5)]
