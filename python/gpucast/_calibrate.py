"""gpucast.calibrate(): fit the communication model to the live process group."""
from __future__ import annotations

import datetime
import statistics
import time

import torch
import torch.distributed as dist


def calibrate(sizes: tuple = tuple(2**k for k in range(16, 27, 2)), repeats: int = 5, timeout_s: float = 60.0,
              group=None) -> dict:
    """Time all-reduces of `sizes` bytes on the initialized process group and fit a ring link to them:
    alpha_us (latency per step) and bytes_per_us. Every rank must call it. A collective that does not finish
    within timeout_s raises instead of hanging."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("gpucast.calibrate: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group(...) on every rank first")
    if repeats < 1 or any(int(s) < 4 for s in sizes):
        raise ValueError(f"gpucast.calibrate: sizes must be at least 4 bytes and repeats at least 1, got {sizes!r}, "
                         f"{repeats!r}")
    ranks = dist.get_world_size(group)
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    timeout = datetime.timedelta(seconds=timeout_s)
    samples = []
    for size in sizes:
        t = torch.ones(int(size) // 4, dtype=torch.float32, device=device)
        times = []
        for i in range(repeats + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            work = dist.all_reduce(t, group=group, async_op=True)
            try:
                ok = work.wait(timeout)
            except RuntimeError as e:
                raise TimeoutError(f"gpucast.calibrate: an all-reduce of {size} bytes did not complete within "
                                   f"{timeout_s:g} s on {ranks} ranks ({backend}): {e}") from e
            if ok is False:
                raise TimeoutError(f"gpucast.calibrate: an all-reduce of {size} bytes did not complete within "
                                   f"{timeout_s:g} s on {ranks} ranks ({backend})")
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:
                times.append((time.perf_counter() - t0) * 1e6)
        samples.append((float(size), statistics.median(times)))
    alpha, bw = torch.ops.gpucast.fit_allreduce([s for s, _ in samples], [u for _, u in samples], ranks)
    return {"ranks": ranks, "backend": backend, "alpha_us": alpha, "bytes_per_us": bw,
            "samples": [{"bytes": s, "us": u} for s, u in samples]}
