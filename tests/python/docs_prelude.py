"""The names the documentation's Python examples use, at small sizes (tests/python/test_docs.py runs it first).

A reader's own training script defines these; the examples in README.md and docs/*.md assume them:
model, opt, make_batch(n), step(batch) and one batch. A two-layer classifier keeps every example to seconds.
"""
import torch

import gpucast

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def make_batch(n: int):
    return torch.randn(n, 32), torch.randint(0, 10, (n,))


def step(batch) -> None:
    x, y = batch
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


batch = make_batch(8)
