"""gpucast.calibrate(): fit the communication model to the live process group."""
from __future__ import annotations

import datetime
import functools
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from ._errors import error_code
from ._warnings import warn


# Defaults chosen, not tuned on a recorded sweep: sizes 64 KiB to 64 MiB by 4x, timeout 60 s.
def calibrate(sizes: tuple = tuple(2**k for k in range(16, 27, 2)), repeats: int | None = None,
              timeout_s: float = 60.0, group=None) -> dict:
    """Time all-reduces of `sizes` bytes on the initialized process group and fit a ring link to them:
    alpha_us (latency per step) and bytes_per_us; the samples themselves are kept (the forecast interpolates
    between them). Every rank must call it. A collective that does not finish within timeout_s raises instead
    of hanging. repeats: rounds over the sizes; None: 9 on a GPU backend, 27 on a CPU one, whose samples are
    means of a heavy-tailed time (a scheduler tick now and then), which few rounds put low more often than not.
    On a GPU backend (nccl) each size's median on the idle group; on a CPU backend each size's mean
    right after a burst of compute on every rank, timed from the last rank's arrival (see _after_compute);
    samples_gap_us: that burst's mean duration. A CPU collective is slower the longer the group sat idle before
    it, so a second sweep over the sizes up to 4 MiB follows a burst five times longer: late_samples, after
    late_gap_us (left out where that burst was not the longer one). send_samples: a point-to-point send
    of each size between the group's first two ranks, one way (half the median round trip over repeats // 3
    rounds, at least 3): what a pipeline stage's output and gradient take to the next stage (the forecast prices
    pipeline sends from them; without them, from alpha_us and bytes_per_us). all_gather_samples and
    reduce_scatter_samples: all_gather_into_tensor and reduce_scatter_tensor of each size (the whole tensor's
    bytes), timed as the all-reduces are over repeats // 3 rounds (at least 3): FSDP's and ZeRO's collectives are
    priced from them (without them, as half an all-reduce; gloo's reduce-scatter costs about a whole one).

    On a CPU backend (gloo) the ranks share this host, and the result also says how they share it:
    memory_contention and compute_contention (a large copy and a matmul timed on rank 0 alone, then on every
    rank at once, the slowest rank's: slowdown factors; memory_contention_samples: the copy's factor by working
    set, copies of 1, 4, 16 and 64 MiB, since what fits the shared caches beside the other ranks' work hardly
    slows down), balance (this host's FLOP per byte from those two, which splits a layer's time into memory- and
    compute-bound shares) and overlap: False where the ranks' threads fill every core
    (LOCAL_WORLD_SIZE, else the world size, times torch.get_num_threads(), against the cores this process may
    run on), so that a collective takes its cores from the compute instead of running beside it. More threads
    than cores set both factors to at least threads / cores (time sharing). sync_wait_us: how much later than
    the average rank the last one finishes the same work started together (ranks sharing cores drift apart);
    a step's first data-parallel reduction waits that long. drift_compute and drift_memory: that lag's mean per
    unit of time, for matmuls and for copies; where given, a step's first reduction waits the compute since the
    ranks last met times these rates (by the compute's memory-bound share) instead. Left out where the ranks'
    threads are more than the cores (their drift is then time sharing, which the contention factors count). ddp_overhead_us: what a DDP
    step costs outside backward beyond the plain module's forward and optimizer step (a small model, plain and
    wrapped, every rank at once): the wrapper, and the collective's threads finishing on the shared cores while the
    next work runs. ddp_overhead_samples: the same on two models, [{"bytes": gradient bytes, "us": ...}], 19 KB and
    2.3 MB (the threads' aftermath grows with the bytes they moved); the forecast reads it by the gradient bytes a
    rank reduces. fsdp_overhead_unit_us, fsdp_overhead_layer_us, fsdp_overhead_mib_us: what FSDP2 (fully_shard)
    spends in a step beside its collectives (hooks, copies into and out of the gathered buffers, the optimizer over
    sharded tensors), per unit, per layer with parameters and per MiB of parameters, from three small models
    sharded over one-rank groups on every rank at once (left out where FSDP2 cannot be imported)."""
    # The arguments first: a bad one is said before any collective runs.
    try:
        [int(s) for s in sizes]
    except (TypeError, ValueError) as e:
        raise ValueError(f"gpucast.calibrate: sizes must be byte counts (integers of at least 4), got {sizes!r}") from e
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"gpucast.calibrate: timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if (repeats is not None and repeats < 1) or any(int(s) < 4 for s in sizes):
        raise ValueError(f"gpucast.calibrate: sizes must be at least 4 bytes and repeats at least 1, got {sizes!r}, "
                         f"{repeats!r}")
    if len({int(s) for s in sizes}) < 2:
        raise ValueError(f"gpucast.calibrate: sizes must hold at least two different sizes (the link's latency and "
                         f"bandwidth are fitted to them), got {sizes!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("gpucast.calibrate: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group(...) on every rank first")
    ranks = dist.get_world_size(group)
    if ranks < 2:
        raise ValueError(f"gpucast.calibrate: the process group has {ranks} rank; a link needs at least 2 (call it "
                         f"on every rank of a group of two or more)")
    backend = dist.get_backend(group)
    if repeats is None:
        # 9 and 27: chosen defaults, no recorded sweep (CPU samples are means of a heavy-tailed time: 3x the rounds).
        repeats = 9 if backend == "nccl" else 27
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    timeout = datetime.timedelta(seconds=timeout_s)

    def wait(work, what: str) -> None:
        try:
            ok = work.wait(timeout)
        except RuntimeError as e:
            raise TimeoutError(f"gpucast.calibrate: {what} did not complete within {timeout_s:g} s on {ranks} ranks "
                               f"({backend}): {e}") from e
        if ok is False:
            raise TimeoutError(f"gpucast.calibrate: {what} did not complete within {timeout_s:g} s on {ranks} ranks "
                               f"({backend})")

    buffers = [torch.ones(int(size) // 4, dtype=torch.float32, device=device) for size in sizes]
    late = []
    if device.type == "cuda":
        samples = _idle_rounds(sizes, buffers, repeats, group, wait)
    else:
        samples, gap = _after_compute(sizes, buffers, repeats, group, wait, ranks)
        small = [i for i, s in enumerate(sizes) if int(s) <= _LATE_MAX_BYTES]
        if small:
            late, late_gap = _after_compute([sizes[i] for i in small], [buffers[i] for i in small], repeats, group,
                                            wait, ranks, burst=_matmuls(_LATE_MATMULS))
    # repeats // 3, at least 3: chosen, fewer rounds for the secondary collectives.
    sends = _sends(sizes, buffers, max(3, repeats // 3), group, wait)
    del buffers
    sharded = _gathers_and_scatters(sizes, max(3, repeats // 3), group, wait, ranks, device)
    alpha, bw = _fit_link(samples, ranks)
    out = {"ranks": ranks, "backend": backend, "alpha_us": alpha, "bytes_per_us": bw,
           "samples": [{"bytes": s, "us": u} for s, u in samples],
           "send_samples": [{"bytes": s, "us": u} for s, u in sends], **sharded}
    if device.type == "cpu":
        out["samples_gap_us"] = round(gap, 1)
        if late and late_gap > gap:
            out["late_samples"] = [{"bytes": s, "us": u} for s, u in late]
            out["late_gap_us"] = round(late_gap, 1)
        out.update(_host_sharing(ranks, group, wait))
        # On a small model, and by gradient bytes on two (the threads' aftermath grows with what they moved). DDP
        # runs its own collectives (the parameters' broadcast, the buckets' all-reduces), which wait() does not
        # see: on a group of the same ranks with the timeout, so that a peer gone quiet raises instead of hanging.
        sub = dist.new_group(ranks=dist.get_process_group_ranks(group or dist.group.WORLD), timeout=timeout,
                             backend=backend)
        try:
            overheads = [_ddp_overhead(ranks, sub, wait, hidden) for hidden in _DDP_OVERHEAD_WIDTHS]
        except RuntimeError as e:
            raise TimeoutError(f"gpucast.calibrate: DDP's steps on a small model did not complete within "
                               f"{timeout_s:g} s on {ranks} ranks ({backend}): {e}") from e
        finally:
            dist.destroy_process_group(sub)
        out["ddp_overhead_us"] = overheads[0][1]
        out["ddp_overhead_samples"] = [{"bytes": b, "us": us} for b, us in overheads]
        try:
            out.update(_fsdp_overhead(group, wait, timeout))
        except TimeoutError:
            raise
        except Exception as e:  # FSDP's own failure leaves its keys out, not the link
            warn(f"gpucast.calibrate: FSDP's own work could not be measured ({type(e).__name__}: {e}); "
                          f"the forecast leaves it out of FSDP's steps")
    return out


def _fit_link(samples: list, ranks: int) -> tuple:
    """(alpha_us, bytes_per_us) of the ring model fitted to the samples; where a noisy host made the larger sizes
    no slower than the smaller ones (a fit with a non-positive bandwidth), the bandwidth alone (alpha 0), with a
    warning: the forecast interpolates between the samples within their sizes and uses the fit outside them."""
    try:
        return tuple(torch.ops.gpucast.fit_allreduce([s for s, _ in samples], [u for _, u in samples], ranks))
    except ValueError as e:
        if error_code(e) != "link-bandwidth":
            raise
    # T = x * u with u = 2(N-1)/N * S, least squares weighted by 1/T^2: x = sum(u/T) / sum(u^2/T^2).
    n = float(ranks)
    us = [(2.0 * (n - 1.0) / n * s, t) for s, t in samples if s > 0 and t > 0]
    x = sum(u / t for u, t in us) / sum((u / t) ** 2 for u, t in us)
    warn(f"gpucast.calibrate: the all-reduce samples do not grow with the size "
                  f"({', '.join(f'{int(s)} B: {t:.0f} us' for s, t in samples)}; a noisy host?): the link's bandwidth "
                  f"is fitted with no latency; wider sizes or more repeats give a better fit")
    return 0.0, 1.0 / x


# The second CPU sweep (late_samples): sizes up to 4 MiB after a burst five times the first's. What the longer
# idle spell adds to a collective is latency (waking the sleeping collective threads and connections), which the
# larger messages hardly show.
# 4 MiB and 40 matmuls (five times _after_compute's default burst of 8): chosen, not measured.
_LATE_MAX_BYTES = 4 << 20
_LATE_MATMULS = 40


def _matmuls(count: int):
    """A function that multiplies two 256 x 256 matrices `count` times (constant ones: the caller's RNG stays as
    it was)."""
    # 256 x 256: a chosen size, small enough for short bursts.
    a = torch.full((256, 256), 0.5)
    b = torch.full((256, 256), 0.25)

    def run() -> None:
        for _ in range(count):
            a @ b
    return run


def _idle_rounds(sizes, buffers, repeats, group, wait, run=None, what="an all-reduce") -> list:
    """Each size's median time on an otherwise idle process group (GPU collectives: the host only launches
    them). In rounds over the sizes, the first a warm-up, so that a slow spell of the machine spreads over every
    size instead of shifting one."""
    times = [[] for _ in sizes]
    for i in range(repeats + 1):
        for j, (size, t) in enumerate(zip(sizes, buffers)):
            t0 = time.perf_counter()
            wait(run(j) if run else dist.all_reduce(t, group=group, async_op=True), f"{what} of {size} bytes")
            torch.cuda.synchronize()
            if i:
                times[j].append((time.perf_counter() - t0) * 1e6)
    return [(float(size), statistics.median(ts)) for size, ts in zip(sizes, times)]


def _after_compute(sizes, buffers, repeats, group, wait, ranks, burst=None, run=None, what="an all-reduce") -> tuple:
    """Each size's mean time the way a training step meets a CPU collective: every rank computes a burst of
    matmuls first and enters the all-reduce when its own burst ends, so the ranks arrive apart and the early ones
    sleep in the collective. Waking a sleeping thread on a host whose cores are shared (a virtual machine, other
    processes) sometimes costs a scheduler tick, milliseconds for a collective of microseconds; a median hides
    how often that happens, the mean carries it. Each sample is timed from the last rank's arrival to the last
    rank's exit where the ranks share this host's monotonic clock (LOCAL_WORLD_SIZE, else the world size, equal
    to the world size, and that clock finer than a microsecond): the wait for the last rank is sync_wait_us's
    share, counted once, and the ranks leave apart (one's threads wake later), the next collective waiting for
    the last. Where the ranks' threads (LOCAL_WORLD_SIZE times torch.get_num_threads()) are more than the cores,
    up to each rank's own exit instead (a late exit there is time sharing, which the contention factors count).
    Without that shared clock, from the rank's own arrival to its own exit, on the finest clock.
    Every rank's samples count; in rounds over the sizes, the first a warm-up. burst: the compute before each
    sample (by default eight 256 x 256 matmuls); run(j): another collective on the j-th size (what: its name in
    errors) instead of the all-reduce of buffers[j]. Returns the samples and the bursts' mean duration in microseconds
    over every rank (how long the group sat idle before each collective)."""
    burst = burst or _matmuls(8)
    local = _local_ranks(ranks)
    # 1e-6: a chosen bound, a monotonic clock of 1 us or finer.
    shared = local == ranks and time.get_clock_info("monotonic").resolution <= 1e-6
    clock = time.monotonic if shared else time.perf_counter
    arrive = torch.zeros(repeats, len(sizes), dtype=torch.float64)
    done = torch.zeros(repeats, len(sizes), dtype=torch.float64)
    busy = torch.zeros(1, dtype=torch.float64)
    for i in range(repeats + 1):
        for j, (size, t) in enumerate(zip(sizes, buffers)):
            b0 = time.perf_counter()
            burst()
            if i:
                busy += time.perf_counter() - b0
            t0 = clock()
            wait(run(j) if run else dist.all_reduce(t, group=group, async_op=True), f"{what} of {size} bytes")
            t1 = clock()
            if i:
                arrive[i - 1, j], done[i - 1, j] = t0, t1
    # Up to the last rank's exit where the ranks' threads fit the cores: ranks leave a CPU collective apart (one's
    # threads wake later), and in a training loop the next collective waits for the one that left last. Where
    # they do not fit, a rank leaves late because the others' compute holds the cores, which the compute's
    # contention factors (at least threads / cores) already count: up to the rank's own exit.
    fits = local * torch.get_num_threads() <= _cores()
    agreed = torch.tensor([1 if shared else 0, 1 if shared and fits else 0], dtype=torch.int32)  # the same branch
    wait(dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group, async_op=True), "an all-reduce of the clocks")
    if agreed[0].item():
        last = arrive.clone()
        wait(dist.all_reduce(last, op=dist.ReduceOp.MAX, group=group, async_op=True), "an all-reduce of the arrivals")
        if agreed[1].item():
            wait(dist.all_reduce(done, op=dist.ReduceOp.MAX, group=group, async_op=True), "an all-reduce of the exits")
        arrive = torch.minimum(last, done)
    total = torch.cat([(done - arrive).sum(dim=0), busy])
    wait(dist.all_reduce(total, group=group, async_op=True), "an all-reduce of the samples")
    scale = 1e6 / (ranks * repeats)
    return ([(float(size), total[j].item() * scale) for j, size in enumerate(sizes)],
            total[-1].item() * scale / len(sizes))


def _sends(sizes, buffers, repeats, group, wait) -> list:
    """One-way time of a point-to-point send of each size between the group's first two ranks (what a pipeline
    stage's output and its gradient take to the next stage): half the median of `repeats` round trips, a send
    there and the same tensor back, the other ranks waiting at a barrier. The first round trip of each size is a
    warm-up. [(bytes, us)], the first rank's, on every rank."""
    first, second = dist.get_process_group_ranks(group or dist.group.WORLD)[:2]
    me = dist.get_rank()
    cuda = buffers[0].device.type == "cuda"
    times = []
    for size, t in zip(sizes, buffers):
        ts = []
        for i in range(repeats + 1):
            wait(dist.barrier(group=group, async_op=True), "a barrier before the sends")
            t0 = time.perf_counter()
            if me in (first, second):
                peer = second if me == first else first
                order = (dist.isend, dist.irecv) if me == first else (dist.irecv, dist.isend)
                for op in order:
                    wait(op(t, peer, group=group), f"a send of {size} bytes between ranks {first} and {second}")
                    if cuda:
                        torch.cuda.synchronize()
            if i:
                ts.append((time.perf_counter() - t0) * 1e6 / 2)
        times.append(statistics.median(ts))
    out = torch.tensor(times, dtype=torch.float64, device=buffers[0].device)
    wait(dist.broadcast(out, src=first, group=group, async_op=True), "a broadcast of the send times")
    return [(float(size), u) for size, u in zip(sizes, out.tolist())]


def _extra_seconds(plain, wrapped, group, wait, steps: int, blocks: int) -> float:
    """How much longer wrapped() takes than plain() (each runs once and returns its seconds) on this rank, every
    rank at once: three warm-up calls of each, then `blocks` blocks of `steps` calls of plain() and of wrapped() in
    turn, a barrier before each block; the difference of their medians."""
    for _ in range(3):
        plain(), wrapped()
    runs = {"plain": [], "wrapped": []}
    for _ in range(blocks):
        wait(dist.barrier(group=group, async_op=True), "a barrier")
        runs["plain"] += [plain() for _ in range(steps)]
        wait(dist.barrier(group=group, async_op=True), "a barrier")
        runs["wrapped"] += [wrapped() for _ in range(steps)]
    return statistics.median(runs["wrapped"]) - statistics.median(runs["plain"])


# The models _fsdp_overhead shards: (units, linear layers per unit, width): many small units, few large ones, few
# units of many layers.
_FSDP_OVERHEAD_MODELS = ((8, 1, 64), (2, 1, 1024), (2, 6, 64))


# steps 10, blocks 3, and the models above: chosen, not tuned on a recorded sweep.
def _fsdp_overhead(group, wait, timeout=None, steps: int = 10, blocks: int = 3) -> dict:
    """What FSDP2 (fully_shard) spends beside its collectives in a step, per unit, per layer with parameters and
    per MiB of parameters: on every rank at once, each rank's model sharded over a group of that rank alone (its
    collectives move nothing), against the same model plain, in alternating blocks, AdamW; three models
    (_FSDP_OVERHEAD_MODELS) give the three costs (least squares on each rank's differences of medians, a cost
    that comes out below 0 left out and the others fitted again; averaged over the ranks). {} where FSDP2 cannot
    be imported. The caller's RNG stays as it was."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        return {}
    members = dist.get_process_group_ranks(group or dist.group.WORLD)
    me = dist.get_rank()
    backend = dist.get_backend(group)
    # Every rank creates each one (waiting at most `timeout` for the others).
    singles = [dist.new_group(ranks=[r], backend=backend, timeout=timeout) for r in members]
    rng = torch.get_rng_state()
    try:
        mesh = DeviceMesh.from_group(singles[members.index(me)], "cpu")
        rows, extra = [], []
        for units, layers, width in _FSDP_OVERHEAD_MODELS:
            def make(shard: bool):
                m = torch.nn.Sequential(*[torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
                                          for _ in range(units)])
                if shard:
                    for block in m:
                        fully_shard(block, mesh=mesh)
                    fully_shard(m, mesh=mesh)
                return m, torch.optim.AdamW(m.parameters(), lr=0.0)
            x = torch.full((16, width), 0.5)

            def step(m, o) -> float:
                t0 = time.perf_counter()
                o.zero_grad(set_to_none=True)
                m(x).sum().backward()
                o.step()
                return time.perf_counter() - t0

            plain, sharded = make(False), make(True)
            rows.append([units, units * layers, units * layers * (width * width + width) * 4 / 2**20])
            extra.append(1e6 * _extra_seconds(lambda: step(*plain), lambda: step(*sharded), group, wait, steps,
                                              blocks))
        a, y = torch.tensor(rows, dtype=torch.float64), torch.tensor(extra, dtype=torch.float64)
        keep = [0, 1, 2]
        cost = torch.zeros(3, dtype=torch.float64)
        while keep:
            fit = torch.linalg.lstsq(a[:, keep], y.unsqueeze(1)).solution.squeeze(1)
            if (fit >= 0).all():
                cost[keep] = fit
                break
            keep.pop(int(fit.argmin()))
        wait(dist.all_reduce(cost, group=group, async_op=True), "an all-reduce")
        cost /= len(members)
        return {"fsdp_overhead_unit_us": round(cost[0].item(), 1), "fsdp_overhead_layer_us": round(cost[1].item(), 1),
                "fsdp_overhead_mib_us": round(cost[2].item(), 1)}
    finally:
        torch.set_rng_state(rng)
        dist.destroy_process_group(singles[members.index(me)])  # the others' groups are not this rank's


def _gathers_and_scatters(sizes, repeats, group, wait, ranks, device) -> dict:
    """all_gather_samples and reduce_scatter_samples: all_gather_into_tensor and reduce_scatter_tensor of each size
    (the bytes of the whole tensor, each rank holding 1/ranks of it), timed as the all-reduces are (a GPU
    backend's median on the idle group, a CPU backend's mean after a burst of compute) over `repeats` rounds: what
    FSDP's and ZeRO's collectives take (gloo's reduce-scatter costs about a whole all-reduce, not half of one).
    Left out, with a warning, where the backend has no such collective."""
    fulls = [torch.ones(max(1, int(s) // 4 // ranks) * ranks, dtype=torch.float32, device=device) for s in sizes]
    shards = [torch.ones(f.numel() // ranks, dtype=torch.float32, device=device) for f in fulls]
    whole = [f.numel() * 4 for f in fulls]
    runs = {"all_gather_samples": ("an all-gather", "all-gathers", lambda j: dist.all_gather_into_tensor(
                fulls[j], shards[j], group=group, async_op=True)),
            "reduce_scatter_samples": ("a reduce-scatter", "reduce-scatters", lambda j: dist.reduce_scatter_tensor(
                shards[j], fulls[j], group=group, async_op=True))}
    out = {}
    for key, (what, plural, run) in runs.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # the collectives' names, renamed in newer torch
                if device.type == "cuda":
                    samples = _idle_rounds(whole, fulls, repeats, group, wait, run, what)
                else:
                    samples, _ = _after_compute(whole, fulls, repeats, group, wait, ranks, run=run, what=what)
        except (RuntimeError, NotImplementedError) as e:
            warn(f"gpucast.calibrate: {what} cannot run on this process group ({e}); FSDP's and ZeRO's "
                          f"{plural} are priced as half an all-reduce")
            continue
        out[key] = [{"bytes": s, "us": u} for s, u in samples]
    return out


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _local_ranks(ranks: int) -> int:
    """The ranks on this host: LOCAL_WORLD_SIZE, else the world size."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", ranks))


# Chosen sizes, from within a core's cache to beyond the shared ones (see _host_sharing).
_COPY_MIB = (1, 4, 16, 64)


def _host_sharing(ranks: int, group, wait) -> dict:
    """Contention between the ranks on this host's memory and cores, and whether collectives can overlap."""
    rank = dist.get_rank(group)
    matmul = _matmuls(16)

    def copier(mib: int):
        """Copies of `mib` MiB, 128 MiB in all: a working set of 2 x mib MiB (source and destination)."""
        src = torch.full((mib << 20,), 1, dtype=torch.uint8)
        dst = torch.empty_like(src)

        def run() -> None:
            for _ in range(128 // mib):
                dst.copy_(src)
        return run
    # 16 MiB (memory_contention): beyond the caches of most cores. The others: what fits a core's or the shared
    # caches beside the other ranks' hardly slows down; what spills shares the memory's bandwidth.
    copies = {mib: copier(mib) for mib in _COPY_MIB}

    def once(fn, active: bool) -> float:
        wait(dist.barrier(group=group, async_op=True), "a barrier")
        t0 = time.perf_counter()
        if active:
            fn()
        return time.perf_counter() - t0

    for fn in (*copies.values(), matmul):  # warm-up
        fn()
    # Alone and all at once in alternation, so that a slow spell of the machine falls on both; medians.
    runs = {k: [] for k in ("alone_mm", "all_mm", *(f"{m}_{w}" for m in copies for w in ("alone", "all")))}
    # 9 rounds: chosen, not measured.
    for _ in range(9):
        for mib, fn in copies.items():
            runs[f"{mib}_alone"].append(once(fn, rank == 0))
            runs[f"{mib}_all"].append(once(fn, True))
        runs["alone_mm"].append(once(matmul, rank == 0))
        runs["all_mm"].append(once(matmul, True))
    med = {k: statistics.median(v) for k, v in runs.items()}
    # All at once, the group runs at its slowest rank's pace: each all-at-once median is the slowest rank's.
    together = [k for k in runs if k.endswith("_all") or k == "all_mm"]
    slowest = torch.tensor([med[k] for k in together], dtype=torch.float64)
    wait(dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group, async_op=True), "an all-reduce")
    med.update(zip(together, slowest.tolist()))
    alone_copy, all_copy, alone_mm, all_mm = med["16_alone"], med["16_all"], med["alone_mm"], med["all_mm"]
    # How far apart the ranks finish the same work started together (a barrier, two matmul rounds each, every
    # rank at once): the last one's lag behind the average, each round's from the vector of every rank's time,
    # which all ranks hold; its median. Ranks that share cores drift apart by the scheduler's time slices; a
    # step's first collective waits for the last one.
    # The same with copies (16 MiB, 256 MiB in all): memory-bound work drifts further apart. drift_*: the mean lag
    # per unit of the mean time, for each kind of work (a step's lag grows with its compute since the ranks last
    # met, by that compute's kind).
    lags = []
    drift = {"compute": [0.0, 0.0], "memory": [0.0, 0.0]}
    # 12 rounds: chosen, not measured.
    for _ in range(12):
        for kind, work in (("compute", matmul), ("memory", copies[16])):
            wait(dist.barrier(group=group, async_op=True), "a barrier")
            t0 = time.perf_counter()
            work()
            work()
            mine = torch.zeros(ranks, dtype=torch.float64)
            mine[rank] = time.perf_counter() - t0
            wait(dist.all_reduce(mine, group=group, async_op=True), "an all-reduce")
            lag = (mine.max() - mine.mean()).item()
            drift[kind][0] += lag
            drift[kind][1] += mine.mean().item()
            if kind == "compute":
                lags.append(lag)
    # Rank 0's factors, shared with every rank so that all return the same result. Only rank 0 ran the work
    # alone: the others' "alone" times are empty spells, which a coarse clock can read as 0.
    f = torch.zeros(3 + len(copies), dtype=torch.float64)
    if rank == 0:
        balance = (16 * 2 * 256 ** 3 / alone_mm) / (2 * (128 << 20) / alone_copy)  # FLOP/s over bytes/s
        f = torch.tensor([all_copy / alone_copy, all_mm / alone_mm, balance]
                         + [med[f"{m}_all"] / med[f"{m}_alone"] for m in copies], dtype=torch.float64)
    wait(dist.broadcast(f, 0, group=group, async_op=True), "a broadcast")
    cores = _cores()
    local = _local_ranks(ranks)
    # More threads than cores share them in time: at least that factor, however the short measurement fell.
    share = local * torch.get_num_threads() / cores
    # The drift rates only where the threads fit the cores: beyond, the ranks drift apart by the time slices that
    # the contention factors (at least threads / cores) already count, and the constant lag stands for the rest
    # (4 ranks on 2 cores, two runs: 8.74 and 11.15 % mean error with the rates, 2.18 and 2.73 % without them).
    rates = {} if share > 1 else {"drift_compute": round(drift["compute"][0] / drift["compute"][1], 5),
                                  "drift_memory": round(drift["memory"][0] / drift["memory"][1], 5)}
    return {"memory_contention": round(max(f[0].item(), share, 1.0), 4),
            "memory_contention_samples": [{"bytes": 2 * (m << 20),
                                           "factor": round(max(f[3 + i].item(), share, 1.0), 4)}
                                          for i, m in enumerate(copies)],
            "compute_contention": round(max(f[1].item(), share, 1.0), 4),
            "balance": round(f[2].item(), 4), "overlap": local * torch.get_num_threads() < cores,
            "sync_wait_us": round(statistics.median(lags) * 1e6, 1), **rates,
            "cores": cores, "local_ranks": local, "threads": torch.get_num_threads()}


# The hidden widths of the models _ddp_overhead runs (64 inputs, 10 outputs): 19,240 and 2,316,840 bytes of
# gradients (DDP's aftermath grew from about 0.1 ms at 36 KB to 0.55 ms at 2 MB on 2 ranks of a 2-core host, and
# stayed there at 8 MB).
_DDP_OVERHEAD_WIDTHS = ((64,), (724, 724))


# steps 12, blocks 4, batch 16 and the model's 64 inputs, 10 outputs: chosen, not tuned on a recorded sweep.
def _ddp_overhead(ranks: int, group, wait, hidden: tuple = (64,), steps: int = 12, blocks: int = 4) -> tuple:
    """(gradient bytes, microseconds): what a DDP step spends outside backward beyond the plain module's (forward
    and optimizer step), on a small model (64 inputs, ReLU layers of the hidden widths, 10 outputs; batch 16, SGD)
    run plain and wrapped in alternating blocks, every rank at once; each rank's difference of medians, averaged
    over the ranks. The caller's RNG stays as it was."""
    rng = torch.get_rng_state()
    try:
        def make():
            widths = (64, *hidden)
            layers = []
            for a, b in zip(widths, widths[1:]):
                layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
            m = torch.nn.Sequential(*layers, torch.nn.Linear(widths[-1], 10))
            return m, torch.optim.SGD(m.parameters(), lr=0.0)
        plain, plain_opt = make()
        model, opt = make()
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        x = torch.full((16, 64), 0.5)
        y = torch.zeros(16, dtype=torch.long)
        loss_fn = torch.nn.CrossEntropyLoss()

        def outside(m, o) -> float:
            t0 = time.perf_counter()
            o.zero_grad(set_to_none=True)
            loss = loss_fn(m(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            o.step()
            return (t1 - t0) + (time.perf_counter() - t2)

        # (the warm-up also lets DDP rebuild its buckets after the first iteration)
        extra = _extra_seconds(functools.partial(outside, plain, plain_opt), functools.partial(outside, ddp, opt), group,
                               wait, steps, blocks)
        mine = torch.tensor([max(0.0, extra)], dtype=torch.float64)
        wait(dist.all_reduce(mine, group=group, async_op=True), "an all-reduce")
        del ddp
        return sum(p.numel() * p.element_size() for p in model.parameters()), round(mine.item() / ranks * 1e6, 1)
    finally:
        torch.set_rng_state(rng)
