"""Distributed memory on real gloo ranks (tests/python/_dist_ranks.py): each strategy's forecast per rank, exact
bytes, and at or above what the ranks measured. Each job runs as 2 (or 4) fresh processes of this machine."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


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
    peaks = {}
    for out in outs:
        line = json.loads(out.strip().splitlines()[-1])
        peaks[line["rank"]] = line["peak_bytes"]
    return [peaks[r] for r in range(world)]


def forecast(strategy: str, reshard, world: int) -> dict:
    """The job's forecast, from probes in a fresh process (what a test process did before can leave a block that
    changes the probes' allocations by a few bytes)."""
    out = subprocess.run([sys.executable, str(HERE / "_dist_ranks.py"), "--forecast", str(world), strategy,
                          str(reshard)], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


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
    fc = forecast(strategy, reshard, world)
    per_rank = fc["per_rank"]
    assert per_rank == expected
    assert fc["peak"] == max(expected)
    assert not fc["approximate"]
    codes = fc["notes"]
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


def test_tensor_parallel_forecast_of_each_simulated_rank_equals_the_real_rank():
    """Tensor parallelism (parallelize_module: each block's first Linear column-wise, its last row-wise) on 2 gloo
    ranks: each rank's forecast, its probes run as that rank under gpucast.simulated_ranks, is what the real rank
    holds in the usual run (DTensor's shards, the all-reduces' outputs), with no parallel rule applied. gloo's worker
    threads can let go of an all-reduce's tensor late (as for FSDP2): a run then peaks higher by that tensor, a
    block's output of 16 x 48 floats, which the simulated rank does not show (the note says so)."""
    forecasts = [forecast("tp", rank, 2) for rank in range(2)]
    measured = measure("tp", 0, 2)
    for rank, fc in enumerate(forecasts):
        assert fc["ranks"] == [[rank]]
        assert fc["notes"].count("rank-traced") == 1 and not fc["approximate"]
        assert fc["per_rank"] == [fc["peak"]] == [TP_RANK_BYTES]
    for m in measured:
        assert m in (TP_RANK_BYTES, TP_RANK_BYTES + TP_LATE_ALL_REDUCE), measured


# What each rank of the tensor-parallel job holds at its peak in the usual run (both alike: the plan splits every
# block evenly), and the all-reduce output gloo held late in one run of the test under load.
TP_RANK_BYTES = 200564
TP_LATE_ALL_REDUCE = 16 * 48 * 4


def test_simulated_ranks_refuses_bad_arguments_and_a_second_group():
    import gpucast
    import torch.distributed as dist
    with pytest.raises(ValueError, match="rank 2 is not a rank of a world of 2"):
        with gpucast.simulated_ranks(2, 2):
            pass
    with pytest.raises(ValueError, match="world_size must be an integer of at least 1"):
        with gpucast.simulated_ranks(0):
            pass
    with gpucast.simulated_ranks(4, 3):
        assert (dist.get_world_size(), dist.get_rank(), dist.get_backend()) == (4, 3, "fake")
        with pytest.raises(RuntimeError, match="already initialized"):
            with gpucast.simulated_ranks(2):
                pass
    assert not dist.is_initialized()


def test_a_traced_forecast_keeps_its_rank_in_later_step_times():
    """fc.step_time() at another batch reads the probes as the traced rank's too: its layers are not divided by tp
    again, and another world is refused."""
    import warnings
    import gpucast
    import torch
    with gpucast.simulated_ranks(2, 0):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        parallelize_module(mlp, init_device_mesh("cpu", (2,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
        opt = torch.optim.SGD(mlp.parameters(), lr=0.1)

        def step(x):
            opt.zero_grad()
            mlp(x).sum().backward()
            opt.step()

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fc = gpucast.forecast(step, lambda n: torch.randn(n, 32), 16, model=mlp, optimizer=opt, target="cpu",
                                  parallel=dict(tp=2), timing_rounds=1, gnn=None)
    assert fc.traced == {"traced_world": 2, "traced_rank": 0}
    again = fc.step_time(16, parallel=dict(tp=2), gnn=None)
    assert again.per_layer == fc.time.per_layer
    with pytest.raises(ValueError, match="one rank of 2 \\(traced_world\\) but dp=1 x tp=4"):
        fc.step_time(16, parallel=dict(tp=4))


def test_simulated_ranks_parallel_must_describe_the_world():
    """Probes run as one rank of 2 with parallel= describing a world of 4: an error naming both, before any probe."""
    import gpucast
    import torch
    calls = []
    with gpucast.simulated_ranks(2):
        with pytest.raises(ValueError, match=r"one rank of 2 \(traced_world\) but dp=4 x tp=1 x pp=1 is a world of 4"):
            gpucast.forecast(lambda b: calls.append(b), lambda n: torch.zeros(n), 8, target="cpu",
                             parallel={"dp": 4})
    assert calls == []
