"""Distributed memory on real gloo ranks (tests/python/_dist_ranks.py): each strategy's forecast per rank, exact
bytes, and at or above what the ranks measured. Each job runs as 2 (or 4) fresh processes of this machine."""
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import gpucast

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _dist_ranks as ranks  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(strategy: str, reshard, world: int) -> list[int]:
    """Each rank's peak CPU allocator bytes over the job, as the ranks measured it."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(HERE / "_dist_ranks.py"), strategy, str(reshard)],
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-2000:]
        outs.append(out)
    import json
    peaks = {}
    for out in outs:
        line = json.loads(out.strip().splitlines()[-1])
        peaks[line["rank"]] = line["peak_bytes"]
    return [peaks[r] for r in range(world)]


def forecast(strategy: str, reshard, world: int):
    torch.set_num_threads(1)
    model = ranks.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    parallel = {"dp": world, "dp_mode": strategy}
    if strategy == "fsdp":
        parallel.update(fsdp_units=list(model), reshard_after_forward=reshard)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no link: the step time's concern
        fc = gpucast.forecast(lambda b: ranks.step(model, opt, b), lambda n: ranks.make_batch(n, gen),
                              ranks.GLOBAL_BATCH, model=model, optimizer=opt, target="cpu", parallel=parallel,
                              timing_rounds=1)
    by_rank = {r: g["peak_allocated_bytes"] for g in fc.memory.per_rank for r in g["ranks"]}
    return fc, [by_rank[r] for r in range(world)]


# (strategy, reshard_after_forward, ranks, each rank's forecast bytes). DDP and ZeRO-1 over 2 ranks; FSDP2 with
# every top-level child a unit: reshard True and False on 2 ranks, 2 (an int) on 4. The 7-row head does not divide
# by 2 or 4: the last rank holds a row less of it, and of its optimizer state.
CASES = [
    ("ddp", True, 2, [449352, 449352]),
    ("zero1", True, 2, [388626, 382522]),
    ("fsdp", True, 2, [315072, 314680]),
    ("fsdp", False, 2, [307616, 307224]),
    ("fsdp", 2, 4, [248200, 248200, 248200, 247808]),
]


@pytest.mark.parametrize("strategy,reshard,world,expected", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_forecast_per_rank_is_exact_and_not_below_the_ranks(strategy, reshard, world, expected):
    fc, per_rank = forecast(strategy, reshard, world)
    assert per_rank == expected
    assert fc.memory.peak_allocated_bytes == max(expected)
    assert not fc.memory.approximate
    codes = [n["code"] for n in fc.memory.notes]
    if strategy == "fsdp":
        assert codes.count("fsdp2-rule") == 1 and codes.count("gloo-late-frees") == 1
    if strategy == "zero1":
        assert codes.count("zero1-step-order") == 1
    measured = measure(strategy, reshard, world)
    # Every rank at or under its forecast; DDP's and ZeRO-1's within 1 % (FSDP2's forecast is the worst ordering of
    # gloo's worker threads, which a single run rarely shows; the note gives the usual ordering's peak).
    for r, (m, f) in enumerate(zip(measured, per_rank)):
        assert m <= f, (r, m, f)
        if strategy != "fsdp":
            assert f - m <= 0.01 * m, (r, m, f)
