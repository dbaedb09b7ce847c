"""A model compiled with torch.compile, traced and forecast: gpucast's global module and optimizer hooks do nothing
inside the functions TorchDynamo traces (before, Dynamo failed on them and the training step raised)."""
import warnings

import pytest
import torch

import gpucast

pytest.importorskip("torch._dynamo")


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters())
    compiled = torch.compile(model, backend="eager", dynamic=False)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(batch):
        x, y = batch
        loss_fn(compiled(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt, step


def batch(n):
    return torch.randn(n, 16), torch.randint(0, 4, (n,))


def test_a_compiled_step_runs_and_is_recorded_under_a_trace():
    torch._dynamo.reset()
    model, opt, step = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch's own note on global hooks and torch.compile
        with gpucast.trace() as t:
            step(batch(8))
    names = {op.name for op in t.result.ops}
    assert "aten::addmm" in names or "aten::linear" in names
    assert any(op.name.startswith("Optimizer.step#") for op in t.result.ops)
    # the ops of the compiled region are recorded under the module that called it: OptimizedModule
    assert any(op.module.startswith("OptimizedModule") for op in t.result.ops)


def test_a_compiled_step_is_forecast():
    torch._dynamo.reset()
    model, opt, step = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fc = gpucast.forecast(step, batch, 64, model=model, optimizer=opt, target="cpu", probe_batch_sizes=(2, 4))
    assert fc.memory.peak_allocated_bytes > 0
    assert fc.time is not None and fc.time.step_ms > 0
