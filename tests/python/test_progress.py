"""A forecast's progress line: on a terminal only, only once the forecast has run 2 s, cleared at the end."""
import io

import torch

import gpucast
from gpucast import _probes


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_shown_on_a_terminal_after_the_delay_and_cleared():
    now = [0.0]
    out = Terminal()
    p = _probes.Progress(out, delay_s=2.0, clock=lambda: now[0])
    p.show("probe 1 of 3 (batch 2)")
    assert out.getvalue() == ""  # a quick forecast prints nothing
    now[0] = 2.5
    p.show("probe 2 of 3 (batch 4)")
    p.show("probe 3 of 3")
    p.done()
    assert out.getvalue() == ("\rgpucast: probe 2 of 3 (batch 4)" + "\r" + "gpucast: probe 3 of 3".ljust(31)
                              + "\r" + " " * 31 + "\r")


def test_quiet_when_not_a_terminal():
    out = io.StringIO()
    p = _probes.Progress(out, delay_s=0.0)
    p.show("probe 1 of 3 (batch 2)")
    p.done()
    assert out.getvalue() == ""


def test_a_forecast_names_each_probe_and_timing_round(monkeypatch):
    out = Terminal()
    monkeypatch.setattr("sys.stderr", out)
    monkeypatch.setattr(_probes, "PROGRESS_DELAY_S", 0.0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(b):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(b[0]), b[1]).backward()
        opt.step()
    gpucast.forecast(step, lambda n: (torch.randn(n, 8), torch.randint(0, 4, (n,))), 8, model=model, optimizer=opt,
                     probe_batch_sizes=(2, 4, 8), timing_rounds=2)
    shown = [x.strip() for x in out.getvalue().split("\r") if x.strip()]
    assert shown == ["gpucast: probe 1 of 3 (batch 2)", "gpucast: probe 2 of 3 (batch 4)",
                     "gpucast: probe 3 of 3 (batch 8)", "gpucast: timing round 2 of 2, probe 1 of 3 (batch 2)",
                     "gpucast: timing round 2 of 2, probe 2 of 3 (batch 4)",
                     "gpucast: timing round 2 of 2, probe 3 of 3 (batch 8)"]
    assert out.getvalue().endswith("\r")  # cleared
