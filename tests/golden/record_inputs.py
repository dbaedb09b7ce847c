"""Record the golden test's CPU probe traces (tests/data/golden/probes/<case>_<batch>.json.gz).

Each trace is what gpucast.forecast's memory probe records for the case: two iterations of the zoo's training step
(AdamW) at the probe's batch, one thread, traced with the model's module paths. Run once; the golden test then
forecasts from these files only, so its expected values do not depend on this machine's speed or allocator.

    PYTHONPATH=python:. .venv/bin/python tests/golden/record_inputs.py
"""
from __future__ import annotations

import gzip
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]

import gpucast  # noqa: E402
from gpucast._trace import mark_iteration_end  # noqa: E402
from examples import zoo  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from golden_cases import PROBES, PROBE_BATCHES, ZOO_CASES  # noqa: E402


def record(name: str) -> None:
    cases = dict(zoo.CASES)
    cases.update(zoo.real_cases())
    case = cases[name]
    torch.manual_seed(0)
    model = case.make_model()
    opt = zoo.make_optimizer("adamw", model.parameters())
    step = zoo.make_step(model, opt, case.loss_fn)
    step(case.make_batch(PROBE_BATCHES[0]))  # the forecast's untraced warm-up
    for b in PROBE_BATCHES:
        batch = case.make_batch(b)
        with gpucast.trace(model=model) as t:
            for _ in range(2):
                step(batch)
                mark_iteration_end()
        text = t.result.handle.to_json()
        (PROBES / f"{name}_{b}.json.gz").write_bytes(gzip.compress(text.encode(), mtime=0))
        print(f"{name} batch {b}: {len(text) / 1e6:.2f} MB of JSON")


def main() -> int:
    torch.set_num_threads(1)
    PROBES.mkdir(parents=True, exist_ok=True)
    for name in ZOO_CASES:
        record(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
