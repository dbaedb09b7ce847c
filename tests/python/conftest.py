import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "python"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import gpucast  # noqa: E402
from examples import zoo  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(before)


def build(case, optimizer="adamw", batch=None):
    """Model, optimizer, step function and one batch for a zoo or real case."""
    model = case.make_model()
    opt = zoo.make_optimizer(optimizer, model.parameters())
    step = zoo.make_step(model, opt, case.loss_fn)
    return model, opt, step, case.make_batch(batch or min(case.default_batch, 4))


def all_cases():
    cases = dict(zoo.CASES)
    cases.update(zoo.real_cases())
    return cases
