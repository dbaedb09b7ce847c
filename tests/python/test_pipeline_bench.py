"""The live pipeline bench (bench/pipeline_live.py) runs the schedule gpucast simulates and cuts the model where
the forecast's stages begin: both checked here against a forecast of a small nn.Sequential."""
import sys
from pathlib import Path

import pytest
import torch

import gpucast
from examples import zoo

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import pipeline_live as live  # noqa: E402


@pytest.fixture(scope="module")
def forecast():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()) for _ in range(4)),
                                torch.nn.Linear(64, 10))
    opt = zoo.make_optimizer("adamw", model.parameters())
    gen = torch.Generator().manual_seed(1)

    def make_batch(n):
        return torch.randn(n, 64, generator=gen), torch.randint(0, 10, (n,), generator=gen)

    step = zoo.make_step(model, opt, torch.nn.functional.cross_entropy)
    fc = gpucast.forecast(step, make_batch, 16, model=model, optimizer=opt, target="cpu", timing_rounds=1)
    return fc, model


@pytest.mark.parametrize("pp,m", [(2, 4), (3, 5), (2, 1), (4, 2)])
def test_the_bench_runs_each_stage_in_the_order_the_forecast_simulates(forecast, pp, m):
    fc, _ = forecast
    t = fc.step_time(16 * m, parallel=dict(pp=pp, micro_batches=m))
    for s in range(pp):
        spans = sorted((x for x in t.compute if x["stage"] == s and x["kind"] in ("forward", "backward")),
                       key=lambda x: x["start_ms"])
        passes = []
        for x in spans:  # a pass is drawn layer by layer: one entry per run of the same pass
            p = (x["kind"] == "backward", x["micro_batch"])
            if not passes or passes[-1] != p:
                passes.append(p)
        assert passes == live.schedule(s, pp, m), f"stage {s} of {pp}, {m} micro-batches"


def test_the_schedule_of_two_stages_and_four_micro_batches():
    assert live.schedule(0, 2, 4) == [(False, 0), (False, 1), (True, 0), (False, 2), (True, 1), (False, 3),
                                      (True, 2), (True, 3)]
    assert live.schedule(1, 2, 4) == [(False, 0), (True, 0), (False, 1), (True, 1), (False, 2), (True, 2),
                                      (False, 3), (True, 3)]


def test_the_model_is_cut_where_the_forecast_stages_begin(forecast):
    fc, model = forecast
    t = fc.step_time(64, parallel=dict(pp=2, micro_batches=4))
    first = {}
    for layer in t.per_layer:
        first.setdefault(layer["stage"], layer["layer"])
    starts = live.cuts_of(t, model, 2)
    assert starts[0] == 0
    assert first[1].startswith(f"Sequential.{starts[1]}")


def test_a_stage_that_does_not_begin_at_a_top_level_child_is_refused(forecast):
    _, model = forecast

    class Fake:
        per_layer = [{"layer": "Sequential.0.0", "stage": 0}, {"layer": "Sequential.0.1", "stage": 1}]

    with pytest.raises(SystemExit, match=r"the forecast's stages \[0, 0\] do not cut the model"):
        live.cuts_of(Fake, model, 2)
