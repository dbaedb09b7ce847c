"""A trace at the default op cap (2,000,000 ops): how long each thing a user does with it takes and how much memory
it needs above the trace itself. Steps: record (ops to the cap, the rest dropped and counted), stop after a
KeyboardInterrupt inside the with-block (what a caught Ctrl-C costs), counters and summary, iterate the ops lazily,
save, load, and a memory forecast from it (the same trace as three probes; the cpu target, then an H100 with the
allocator simulated and the largest batch searched). Peak resident memory (the kernel's VmHWM, reset before each step) is
printed as the rise above the resident memory just before it (after malloc_trim, so that heap freed by an earlier
step is not reused unseen). Writes nothing but the saved trace (in a temporary folder).

    PYTHONPATH=python:. .venv/bin/python bench/large_trace.py [--ops 2000000]
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import gpucast  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
LIBC = ctypes.CDLL("libc.so.6")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def reset_peak() -> bool:
    """Resets the kernel's peak resident size (VmHWM; Linux 4.0 and later); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def kernel_peak() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


class Step:
    """Times a step and measures its peak resident memory: the kernel's own peak (VmHWM, reset before the step),
    else resident memory sampled every 5 ms (which can miss a short spike)."""

    def __init__(self, name: str, rows: list):
        self.name, self.rows = name, rows

    def __enter__(self):
        # Heap freed by the steps before goes back to the system first: otherwise a step reuses it unseen.
        gc.collect()
        LIBC.malloc_trim(0)
        self.exact = reset_peak()
        self.before, self.peak, self.stop = rss(), rss(), False
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()
        self.t0 = time.perf_counter()
        return self

    def _sample(self):
        while not self.stop:
            self.peak = max(self.peak, rss())
            time.sleep(0.005)

    def __exit__(self, *exc):
        seconds = time.perf_counter() - self.t0
        self.stop = True
        self.sampler.join()
        self.peak = max(self.peak, rss(), kernel_peak() if self.exact else 0)
        self.rows.append((self.name, seconds, (self.peak - self.before) / 2**20, self.peak / 2**20))
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=2_000_000, help="ops to run inside the trace (default: the cap)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows: list = []
    x = torch.ones(4)
    t = gpucast.trace()
    with Step("record", rows):
        try:
            with t:
                # One `x + 1` records about 5 ops (aten::add and what it dispatches to): run past the cap, so
                # that the rest are dropped and counted, then leave the with-block on a KeyboardInterrupt.
                for _ in range(args.ops // 4):
                    x = x + 1
                t0 = time.perf_counter()
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            stop_s = time.perf_counter() - t0  # the with-block's exit after the interrupt
    trace = t.result
    with Step("assemble", rows):  # the trace itself: what the steps below are measured above
        n = trace.handle.num_ops()
    with Step("counters + summary", rows):
        counters = trace.counters
        trace.summary()
    with Step("iterate 100k ops (lazy)", rows):
        sum(1 for _, _ in zip(range(100_000), trace.ops))
    # The same trace as three probes (batch 1, 2, 4): what a forecast holds per probe, three times over.
    f = torch.classes.gpucast.MemoryForecaster()
    for b in (1, 2, 4):
        f.add_probe(trace.handle, b)
    with Step("forecast cpu (3 probes)", rows):
        out = json.loads(f.run(target_batch=8))
    with Step("forecast H100 (3 probes)", rows):  # the allocator simulated, and the largest batch searched
        gpu = json.loads(f.run(target_batch=8, target="H100-80GB"))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "big.json")
        with Step("save", rows):
            trace.save(path)
        size_mb = os.path.getsize(path) / 2**20
        with Step("load", rows):
            back = gpucast.load_trace(path)
        del back
    # Once more after the loaded copy was freed: the heap it leaves (free but resident) serves the forecast's
    # smaller vectors, and a large one that fits in none of its free chunks is new memory beside them.
    with Step("forecast cpu after load", rows):
        json.loads(f.run(target_batch=8))
    print(f"trace: {n:,} ops kept, {counters['dropped_ops']:,} dropped, {trace.handle.num_events():,} events; "
          f"saved {size_mb:,.0f} MiB; forecast warnings: {[w['code'] for w in out['warnings']]}; H100: "
          f"{[w['code'] for w in gpu['warnings']]}")
    print(f"with-block exit after a KeyboardInterrupt: {stop_s:.3f} s")
    print(f"{'step':<24} {'seconds':>8} {'MB above':>9} {'peak MB':>8}")
    for name, s, above, peak in rows:
        print(f"{name:<24} {s:8.2f} {above:9.0f} {peak:8.0f}")
    print(json.dumps({"bench": "large_trace", "ops": n, "dropped_ops": counters["dropped_ops"], "stop_s": stop_s,
                      "saved_mib": round(size_mb, 1),
                      "steps": [{"step": r[0], "seconds": round(r[1], 3), "mb_above": round(r[2], 1),
                                 "peak_mb": round(r[3], 1)} for r in rows]}))


if __name__ == "__main__":
    main()
