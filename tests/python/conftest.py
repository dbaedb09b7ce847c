import json
import struct
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


def token_batch(n, length, vocab=512):
    """n sequences of `length` tokens and their next tokens (the same for the same n and length)."""
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, vocab, (n, length + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def token_loss(logits, y):
    """Cross entropy over every position of a [batch, length, vocab] output."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def all_cases():
    cases = dict(zoo.CASES)
    cases.update(zoo.real_cases())
    return cases


def _fnv1a(b: bytes) -> int:
    h = 1469598103934665603
    for x in b:
        h = ((h ^ x) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def read_weights_header(path: Path) -> dict:
    """The JSON header of a gpucast weights file."""
    b = path.read_bytes()
    n = struct.unpack_from("<I", b, 12)[0]
    return json.loads(b[16:16 + n])


def rewrite_weights_header(src: Path, dst: Path, **changes):
    """A copy of a weights file with header fields changed and the checksum recomputed."""
    b = src.read_bytes()
    n = struct.unpack_from("<I", b, 12)[0]
    header = json.loads(b[16:16 + n])
    header.update(changes)
    h = json.dumps(header).encode()
    body = b[:12] + struct.pack("<I", len(h)) + h + b[16 + n:-8]
    dst.write_bytes(body + struct.pack("<Q", _fnv1a(body)))
