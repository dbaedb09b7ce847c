"""Simulated ranks: the probes run as one rank of a parallel job, in this one process.

Under ``gpucast.simulated_ranks(world_size, rank)`` the default process group is PyTorch's fake backend: every
collective returns at once and moves no data (torch/testing/_internal/distributed/fake_pg.py, which
``init_process_group`` itself imports for it: torch 2.14.1 torch/distributed/distributed_c10d.py:2539). PyTorch's own
DDP, FSDP2, DTensor and tensor parallelism then build and run in this process what rank `rank` of `world_size`
builds: its parameter shards, its activations on them, the buffers the collectives are given. A forecast made inside
is that rank's memory as the engine holds it, with no parallel rule applied (note ``rank-traced``).
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Iterator

import torch


def _check(name: str, value, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"simulated_ranks: {name} must be an integer of at least {least}, got {value!r}")
    return value


@contextlib.contextmanager
def simulated_ranks(world_size: int, rank: int = 0) -> Iterator[None]:
    """Run the body as rank `rank` of `world_size` processes: the default process group is a fake one (no data
    moves, nothing waits), so that the body builds and trains the model as that rank would (init_device_mesh,
    parallelize_module, fully_shard, DistributedDataParallel) and gpucast.forecast inside it forecasts that rank.
    The group is destroyed on exit. One simulated world per process: DTensor caches plans by device meshes, which
    compare equal by shape and ranks whatever groups they hold (torch 2.14.1 device_mesh.py:722), so a second world
    with a mesh like the first's may fail inside DTensor ("Could not resolve the process group"). RuntimeError if a process group is already initialized in this process (a real
    job: forecast it from its own ranks) or torch was built without distributed support."""
    import torch.distributed as dist
    _check("world_size", world_size, 1)
    _check("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"simulated_ranks: rank {rank} is not a rank of a world of {world_size}")
    if not dist.is_available():
        raise RuntimeError("simulated_ranks: this torch was built without torch.distributed")
    if dist.is_initialized():
        raise RuntimeError("simulated_ranks: a process group is already initialized in this process; simulated "
                           "ranks need the default group to themselves")
    fake_pg = importlib.import_module("torch.testing._internal.distributed.fake_pg")  # registers the backend
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        if dist.is_initialized():  # the body may have destroyed it
            dist.destroy_process_group()


def traced_rank() -> tuple[int, int] | None:
    """(world size, rank) when this process runs under simulated_ranks (the default group's backend is fake), else
    None."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return None
    if dist.get_backend() != "fake":
        return None
    return dist.get_world_size(), dist.get_rank()
