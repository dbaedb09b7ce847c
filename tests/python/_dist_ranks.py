"""One rank of a small parallel job over gloo, for tests/python/test_dist_memory.py: builds the model, wraps it
as the strategy says (DDP, ZeroRedundancyOptimizer over DDP, FSDP2's fully_shard per block and on the root, tensor
parallelism: parallelize_module on each block, its first Linear column-wise and its last row-wise), trains
3 steps of AdamW and prints, as one JSON line, the most bytes the CPU allocator held at once from before the model
was built (gpucast.trace's window peak: its allocator hook sees every thread, gloo's included).

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... python tests/python/_dist_ranks.py STRATEGY [RESHARD]

With --forecast WORLD first, it forecasts the same job from single-process probes instead (in a fresh process, so
that nothing a test process did before changes the probes' allocations) and prints fc.memory's per-rank peaks, its
largest, whether it is approximate and its note codes, as one JSON line. For "tp" the forecast is one rank's, made
under gpucast.simulated_ranks(WORLD, RANK) from probes of that rank's own job (the second argument is RANK).
"""
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
GLOBAL_BATCH = 16
STEPS = 3


def make_model() -> nn.Sequential:
    """An input layer, two MLP blocks and a 7-way head: 7 rows do not divide by 2 or 4 ranks (FSDP2 pads them)."""
    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 48))  # noqa: E731
    return nn.Sequential(nn.Linear(30, 48), block(), block(), nn.Linear(48, 7))


def make_batch(n: int, gen: torch.Generator):
    return torch.randn(n, 30, generator=gen), torch.randint(0, 7, (n,), generator=gen)


def step(model, opt, batch) -> None:
    opt.zero_grad(set_to_none=True)
    x, y = batch
    F.cross_entropy(model(x), y).backward()
    opt.step()


def wrap(model, strategy: str, reshard):
    if strategy == "ddp":
        m = nn.parallel.DistributedDataParallel(model)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3)
    if strategy == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        m = nn.parallel.DistributedDataParallel(model)
        return m, ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    if strategy == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        for block in (model[1], model[2]):
            parallelize_module(block, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    for child in model:
        fully_shard(child, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def forecast_rank(world: int, rank: int) -> dict:
    """The tensor-parallel job's forecast for one rank, its probes run as that rank on a simulated process group."""
    import warnings
    import gpucast
    torch.set_num_threads(1)
    with gpucast.simulated_ranks(world, rank):
        model, opt = wrap(make_model(), "tp", None)
        gen = torch.Generator().manual_seed(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no link: the step time's concern
            fc = gpucast.forecast(lambda b: step(model, opt, b), lambda n: make_batch(n, gen), GLOBAL_BATCH,
                                  model=model, optimizer=opt, target="cpu", parallel={"tp": world}, timing_rounds=1)
    m = fc.memory
    return {"per_rank": [g["peak_allocated_bytes"] for g in m.per_rank], "ranks": [g["ranks"] for g in m.per_rank],
            "peak": m.peak_allocated_bytes, "approximate": m.approximate, "notes": [n["code"] for n in m.notes]}


def forecast(strategy: str, reshard, world: int) -> dict:
    import warnings
    import gpucast
    torch.set_num_threads(1)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    parallel = {"dp": world, "dp_mode": strategy}
    if strategy == "fsdp":
        parallel.update(fsdp_units=list(model), reshard_after_forward=reshard)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no link: the step time's concern
        fc = gpucast.forecast(lambda b: step(model, opt, b), lambda n: make_batch(n, gen), GLOBAL_BATCH, model=model,
                              optimizer=opt, target="cpu", parallel=parallel, timing_rounds=1)
    m = fc.memory
    by_rank = {r: g["peak_allocated_bytes"] for g in m.per_rank for r in g["ranks"]}
    return {"per_rank": [by_rank[r] for r in range(world)], "peak": m.peak_allocated_bytes,
            "approximate": m.approximate, "notes": [n["code"] for n in m.notes]}


def main() -> None:
    sys.path[:0] = [str(ROOT / "python")]
    import gpucast
    args = sys.argv[1:]
    world = int(args.pop(1)) if args[0] == "--forecast" else None
    if world is not None:
        args.pop(0)
    strategy = args[0]
    reshard = {"True": True, "False": False}.get(args[1], None) if len(args) > 1 else True
    if reshard is None:
        reshard = int(args[1])
    if world is not None and strategy == "tp":
        print(json.dumps(forecast_rank(world, reshard)), flush=True)
        return
    if world is not None:
        print(json.dumps(forecast(strategy, reshard, world)), flush=True)
        return
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    # Tensor-parallel ranks share one batch (of the whole size); data-parallel ones take their own share.
    share = world if strategy != "tp" else 1
    gen = torch.Generator().manual_seed(1 + (rank if share > 1 else 0))
    with gpucast.trace(record_shapes=False) as t:
        model, opt = wrap(make_model(), strategy, reshard)
        for _ in range(STEPS):
            step(model, opt, make_batch(GLOBAL_BATCH // share, gen))
    print(json.dumps({"rank": rank, "peak_bytes": t.peak_bytes("cpu")}), flush=True)
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
