"""The probes of gpucast.forecast(): the training step traced at small sizes, then timed in steady state, with
timing-only probes where the target batch needs them and timing rounds; the model's, optimizers' and RNG's state
saved before and restored after. Python runs them because it owns the step, the batches and the state; what they
record is forecast in C++."""
from __future__ import annotations

import contextlib
import copy
import gc
import json
import statistics
import sys
import time
from typing import Any, Callable, Iterable

import torch

from . import _meta
from ._settings import _time_on_target
from ._trace import _flatten, mark_iteration_end, trace


def _storage_ptrs(objs: Iterable[Any]) -> list[int]:
    """How a trace names the storages the tensors in `objs` hold (torch.ops.gpucast.storage_identities: the data
    pointer, a meta storage's token); a tensor subclass that wraps others (a DTensor and its local shard) is read
    through the tensors it wraps (__tensor_flatten__)."""
    plain, out = [], []
    for t in _flatten(list(objs), []):
        inner = _wrapped(t)
        if inner is not None:
            out += _storage_ptrs(inner)
        else:
            plain.append(t)
    try:
        ids = list(torch.ops.gpucast.storage_identities(plain))
    except (RuntimeError, NotImplementedError, TypeError):  # a subclass that does not pass through ops: one by one
        ids = []
        for t in plain:
            try:
                ids += list(torch.ops.gpucast.storage_identities([t]))
            except (RuntimeError, NotImplementedError, TypeError):
                try:
                    ids.append(t.untyped_storage().data_ptr())
                except (RuntimeError, NotImplementedError, TypeError):
                    continue
    return out + [p for p in ids if p]


def _wrapped(t: torch.Tensor) -> list | None:
    """The inner tensors of a wrapper tensor subclass (DTensor: its local tensor), None for a plain tensor."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    if not is_traceable_wrapper_subclass(t):
        return None
    names, _ = t.__tensor_flatten__()
    return [getattr(t, n) for n in names]


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of a tensor's state on the CPU (a GPU's baseline then holds the job's memory only); a meta tensor's
    copy stays on meta (it has no values to keep, and costs nothing)."""
    return t.detach().clone() if t.is_meta else t.detach().to("cpu", copy=True)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return _copy(obj) if obj.device.type != "cpu" else obj
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


# Meta probes: the model and batches on the meta device, or neither.
def _meta_mixed(batches_on_meta: bool) -> str:
    if batches_on_meta:
        return ("forecast: the batches are on the meta device but the model's parameters are not (or the model was not "
                "given as model=); build both on meta (probes that hold no memory, for a GPU target, with model= "
                "given) or both on the CPU")
    return ("forecast: the model's parameters are on the meta device but the batches are not; make make_batch return "
            "meta tensors (torch.empty(..., device='meta')), or build both on the CPU")


class _State:
    """The model's and optimizer's state (and the RNG's), saved before the probes and restored after."""

    def __init__(self, model, optimizers: list):
        self.model, self.optimizers = model, optimizers
        self.rng = torch.get_rng_state()
        self.model_state = None
        self.grads = None
        # Copies live on the CPU, so that a GPU's baseline holds the job's memory only (a meta tensor's copy stays on
        # meta: it holds nothing).
        if model is not None:
            self.model_state = {k: _copy(v) for k, v in model.state_dict().items()}
            self.grads = [None if p.grad is None else _copy(p.grad) for p in model.parameters()]
        self.optimizer_states = [_to_cpu(copy.deepcopy(o.state_dict())) for o in optimizers]

    def own_ptrs(self) -> list[int]:
        """Storages of the copies, and of gpucast's loaded learned models (the step graph network's weights, loaded
        at a forecast and kept), so the forecast does not count them as the job's."""
        objs = [self.rng]
        if self.model_state is not None:
            objs += list(self.model_state.values()) + [g for g in self.grads if g is not None]
        objs += [st["state"] for st in self.optimizer_states]
        return _storage_ptrs(objs) + list(torch.ops.gpucast.owned_storages())

    def restore(self):
        torch.set_rng_state(self.rng)
        if self.model is not None:
            self.model.load_state_dict(self.model_state)
            for p, g in zip(self.model.parameters(), self.grads):
                p.grad = None if g is None else g.to(p.device, copy=True)
        for o, st in zip(self.optimizers, self.optimizer_states):
            # load_state_dict may keep the given tensors (the step counts): hand it a copy.
            o.load_state_dict(copy.deepcopy(st))


def _device_of(batch: Any) -> str:
    tensors = _flatten(batch, [])
    return str(tensors[0].device) if tensors else "cpu"


def _timing_probe_target(timings: list, per_rank: int, target: str, probe_device: str, design: list,
                         gpu: bool = False) -> int | None:
    """Each rank's batch where timing-only probes may be added (CPU probes for a CPU target; with gpu, GPU probes
    for a GPU target too; batch probes only); None elsewhere."""
    on_target = (target == "cpu" and probe_device == "cpu") or (gpu and _time_on_target(target, probe_device))
    if not on_target or not timings or any(x[1] is not None for x in design):
        return None
    return per_rank


# PyTorch's CPU convolution runs 1x1, stride-1 kernels on one thread through im2col (thnn_conv2d) below this
# batch size and through mkldnn from it on (aten/src/ATen/native/Convolution.cpp, ConvParams::use_mkldnn).
_MKLDNN_CONV_MIN_BATCH = 16


def _kernel_probes(timings: list, per_rank: int, target: str, probe_device: str, design: list) -> list:
    """Batch sizes to time in addition to the probes, so that every layer is timed on the kernels the target
    batch runs: where the probes' convolutions took the CPU im2col path and the per-rank target batch is at
    least 16, probes at 16 and at 24 (when the target is that large). Timing only: the memory forecast keeps
    the probes' traces."""
    per_rank = _timing_probe_target(timings, per_rank, target, probe_device, design)
    largest = max(b for b, _ in design)
    if per_rank is None or per_rank < _MKLDNN_CONV_MIN_BATCH or largest >= _MKLDNN_CONV_MIN_BATCH:
        return []
    if not any(json.loads(x).get("im2col_conv_ops", 0) > 0 for x in timings):
        return []
    lo = _MKLDNN_CONV_MIN_BATCH
    return [lo] + ([lo + lo // 2] if per_rank >= lo + lo // 2 else [])


# Beyond this many times the largest probe, a slope's noise is multiplied into the forecast, and on a CPU the time
# per sample changes with the batch: it grows as the activations spill the caches (the zoo MLP's first layer: 4.1 us
# per sample from 8 to 64, 4.7 from 64 to 256) and falls where small matrix multiplies run below the kernels' peak
# (the zoo LSTM on an AMD EPYC host: 0.61 ms per sample at batch 8, 0.39 at 32; forecast at 32 from 2/4/8: -15.4,
# -12.0, -19.6 % in three runs, with a probe at 16: -7.8, -11.1, -8.2 %, the CNN at 32 alongside +0.9, -3.1, +6.0
# and +5.0, +0.5, +1.8 %): a timing probe at half the per-rank target is added when the probes forecast its step
# under the budget (CPU targets).
_REACH = 3
# 1 s: a chosen budget for the added probe, not measured.
_REACH_BUDGET_S = 1.0


def _reach_probes(timings: list, per_rank: int, target: str, probe_device: str, design: list,
                  fits: Callable[[int], bool] | None = None) -> list:
    """A batch size to time in addition, nearer a target far beyond the probes: half the per-rank target where the
    target is more than _REACH times the largest probe and the probes forecast the step at that half under
    _REACH_BUDGET_S. On a GPU that is the target (probes on it) too, where fits(b) says that the probe's memory
    fits the device now (its kernels at batch 4 to 16 say little about the rates of kernels 30 times larger:
    ResNet-18 at 512 on an H200 forecast 23 % high from 4, 8 and 16); fits None: not on a GPU."""
    per_rank = _timing_probe_target(timings, per_rank, target, probe_device, design, gpu=fits is not None)
    largest = max((json.loads(x)["batch"] for x in timings), default=0)
    if per_rank is None or per_rank <= _REACH * largest:
        return []
    b = per_rank // 2
    est = json.loads(torch.ops.gpucast.forecast_step_time(timings, b))
    if est["step_ms"] > _REACH_BUDGET_S * 1e3:
        return []
    return [b] if fits is None or fits(b) else []


# A GPU timing probe runs only where the memory forecast at its batch stays within this share of what this process
# can hold on the device (the free memory and what its allocator has reserved).
# 0.8: a chosen margin, a fifth kept for what the forecast misses; not measured.
_REACH_MEMORY_SHARE = 0.8


def _probe_fits(peak_reserved_bytes: int, free_bytes: int, reserved_bytes: int) -> bool:
    """Whether a probe whose forecast reserved peak is peak_reserved_bytes (the process's whole reservation, its
    current one included) fits in _REACH_MEMORY_SHARE of the device memory free now plus what the allocator holds."""
    return peak_reserved_bytes <= _REACH_MEMORY_SHARE * (free_bytes + reserved_bytes)


# A memory probe at this many times the largest probe, where the per-rank target lies at least that far: a kernel that
# allocates otherwise from some size on (PyTorch's CPU convolution leaves im2col for mkldnn at batch 16 for 1x1,
# stride-1 kernels on one thread: aten/src/ATen/native/Convolution.cpp, ConvParams::use_mkldnn; oneDNN and cuBLAS
# pick their blocking and scratch by the problem's size) is invisible to the probes below it. If the check probe
# allocates otherwise than the largest, a second at _CHECK_AFTER times the largest gives the new allocations a line.
# 2 and 3: chosen, the nearest sizes that double the reach; not tuned on a recorded sweep.
_CHECK_FACTOR = 2
_CHECK_AFTER = 3
# A check probe runs only where its memory forecast fits _REACH_MEMORY_SHARE of what the probe device has free and its
# time, estimated from the largest probe's in proportion to the batch, stays within this many seconds or this many
# times the time of the probes run before it (the design's, and a first check probe's), whichever is more. 5 s and
# 1.5: chosen, not measured.
_CHECK_BUDGET_S = 5.0
_CHECK_BUDGET_SHARE = 1.5


def _host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where it cannot be read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# Timing rounds where the probes run on the CPU (forecast's timing_rounds None). On a shared 2-core host a probe's
# untraced step moved by up to 42 % between rounds a few seconds apart, and a forecast at 2 to 32 times the largest
# probe multiplies a slope's error: over 40 forecasts of the accuracy bench's ten cases (bench/timing_rounds.py,
# 2026-12-06, without the graph network) the step's mean |error| was 6.86 % (RMS 10.38) from the first round alone,
# 4.88 % from the median of two rounds and 4.45 % (RMS 6.40) from that of three. A GPU's clocks are steadier: 1 there.
# Those figures: bench/results/timing_rounds.txt:43-51.
_CPU_TIMING_ROUNDS = 3


PROGRESS_DELAY_S = 2.0


class Progress:
    """One line of progress on a terminal, rewritten in place ("gpucast: probe 2 of 3 (batch 4)"), shown only once
    the forecast has run `delay_s` (PROGRESS_DELAY_S by default: a quick forecast prints nothing) and never when the stream is not a terminal (a
    log file, a pipe, a notebook's captured stderr). done() clears what was shown."""

    def __init__(self, stream=None, delay_s: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.stream = sys.stderr if stream is None else stream
        self.on = bool(getattr(self.stream, "isatty", lambda: False)())
        self.delay_s = PROGRESS_DELAY_S if delay_s is None else delay_s
        self.clock, self.start, self.width = clock, clock(), 0

    def show(self, text: str) -> None:
        if not self.on or self.clock() - self.start < self.delay_s:
            return
        line = f"gpucast: {text}"
        self.stream.write("\r" + line.ljust(self.width))
        self.stream.flush()
        self.width = max(self.width, len(line))

    def done(self) -> None:
        if self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0


def _retimed(step: Callable[[Any], Any], make_batch: Callable[..., Any], b: int, length: int | None, structure: str,
             timed_layers: list | None, model: torch.nn.Module | None, state: "_State") -> str:
    """A probe's steady timing again, in a later round (no memory trace: its structure is the first round's). Two
    untraced warm-ups: the state restored after the last probe has no optimizer state yet."""
    gc.collect()
    batch = make_batch(b) if length is None else make_batch(b, length)
    try:
        timing = _steady_timing(step, batch, b, structure, timed_layers, warm=2, model=model)
    finally:
        del batch
        state.restore()
    return timing if length is None else _with_seq(timing, length)


def _round_median(rounds: list) -> list:
    """Per probe, the element-wise median over the timing rounds (each layer's forward and backward time, the
    optimizer's, the rest's, the wall and the untraced wall; torch.ops.gpucast.median_timing): a slow spell of
    the machine that fell on one round of a probe does not tilt the fits' slopes, which extrapolation multiplies."""
    return [torch.ops.gpucast.median_timing(list(texts)) for texts in zip(*rounds)]


# warm 1, runs 3, traced 3 to 9, budget_s 0.1: chosen defaults, not tuned on a recorded sweep.
def _steady_timing(step: Callable[[Any], Any], batch: Any, b: int, structure: str,
                   timed_layers: list | None = None, warm: int = 1, runs: int = 3, traced: tuple = (3, 9),
                   budget_s: float = 0.1, model: torch.nn.Module | None = None) -> str:
    """A probe's timing in steady state. The memory trace just before ran the first iterations (optimizer state
    created, caches and the allocator's free lists cold); the step's time comes from what follows it: `warm`
    untraced iterations (the last one's time sizes what follows), then untraced and traced iterations in
    alternation, as many of each, so that a slow spell of the machine falls on both: the untraced ones' median is
    the untraced wall, which lets the forecast take the tracer's own cost out of the traced times by op count
    (at least `runs` of them). The traced ones are light traces, each iteration in its own (no shapes, no memory
    events, and ops nested in another op counted in it instead of recorded: a fraction of the tracer's cost per
    op): as many as take about budget_s at the untraced wall, from traced[0] to traced[1], and of those the
    element-wise median (each layer's time, the optimizer's, the rest of the step's and the wall: a pause of the
    machine in one run or two does not move it).
    What needs shapes and allocations (FLOPs, bytes, gradient and output bytes, the layer graph) comes from
    `structure`: the iteration timing of the full trace of the same step. timed_layers: sparse timing
    (gpucast.trace's timed_layers). model: forecast's, for the traces' module paths (gpucast.trace's model)."""
    cuda = any(t.is_cuda for t in _flatten(batch, []))

    def once() -> int:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        step(batch)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter_ns() - t0

    first = 0
    for _ in range(max(1, warm)):  # the last warm-up's time sizes the number of traces
        first = once()
    count = max(traced[0], min(traced[1], int(budget_s * 1e9 // max(first, 1))))
    times, light = [], []
    for _ in range(max(count, runs)):
        times.append(once())
        if len(light) < count:
            with trace(timed_layers=timed_layers, model=model, record_shapes=False, memory=False,
                       nested_ops=False) as t:
                step(batch)
                mark_iteration_end()
            light.append(t.result.handle.iteration_timing(b))
            del t
    return torch.ops.gpucast.timing_with_structure(torch.ops.gpucast.median_timing(light), structure,
                                                   untraced_wall_ns=float(statistics.median(times)))


def _with_seq(timing: str, length: int) -> str:
    """An iteration timing marked with the probe's sequence length."""
    return torch.ops.gpucast.timing_with_seq(timing, int(length))


class ProbeRun:
    """One forecast's probes, run in order by run(): an untraced warm-up, the design's probes traced (a memory trace
    each, then a steady timing where the probes run on the target), timing-only probes where the target's kernels
    start (CPU im2col) or where the target lies far beyond the probes, more timing rounds, and the workspaces that
    cuDNN or the CPU matrix multiplies take at the target batch. What it leaves: `forecaster` (the C++ memory
    forecaster holding the probe traces), `timings` (the per-probe timings, each the median over `rounds`),
    `probe_device` and what was added or skipped (for the forecast's notes). The state is restored afterwards,
    whatever happens."""

    def __init__(self, step: Callable[[Any], Any], make_batch: Callable[..., Any], *, model, state: "_State",
                 design: list, iterations: int, target: str, per_rank: int, tp: int, time_fraction: float,
                 time_budget: float, timing_rounds: int | None, conv_workspace: int | None,
                 fits: Callable[["ProbeRun", int], bool] | None = None, meta: bool = False):
        self.step, self.make_batch, self.model, self.state = step, make_batch, model, state
        self.design, self.iterations, self.target, self.per_rank, self.tp = design, iterations, target, per_rank, tp
        self.time_fraction, self.time_budget = time_fraction, time_budget
        self.timing_rounds, self.conv_workspace = timing_rounds, conv_workspace
        self.fits_on_device = fits  # (run, batch) -> whether a GPU timing probe at that batch fits (None: no check)
        self.meta = meta  # probes on the meta device (the model's parameters there)
        self.forecaster = torch.classes.gpucast.MemoryForecaster()
        self.probe_device = "cpu"
        self.timings: list = []
        self.kernel_probes: list = []  # timing-only probes at the batch sizes where the target's kernels start
        self.reach_probes: list = []  # a timing-only probe nearer a target far beyond the probes
        self.reach_skipped: list = []  # such probes the device refused (out of memory)
        self.timed_layers = None  # sparse timing: the layers the timing traces time (None: every layer)
        self.largest_probe = None  # the largest probe's trace (batch scaling only)
        self.previous_probe = None  # the one before it
        self.probe_batches: list = []
        self.retime: list = []  # each timing's (batch, length, structure): what a later round times again
        self.rounds: list = []  # each timing round's timings (timing_rounds > 1)
        self.conv_skipped: list = []
        self.op_skipped: list = []
        # Memory-only probes beyond the design: (batch, the probe before it, where it allocates otherwise than that one).
        self.check_probes: list = []
        self.check_skipped: str = ""  # why no check probe ran where the target lay beyond it ("" none or ran)
        self.probe_seconds: list = []  # each design probe's memory trace, wall seconds
        self.progress = Progress()  # on a terminal, once the forecast takes more than 2 s

    def run(self) -> "ProbeRun":
        with contextlib.ExitStack() as scope:
            if self.meta:
                scope.enter_context(_meta.probe_scope())
            return self._run()

    def _run(self) -> "ProbeRun":
        try:
            # The probes are timed with the C allocator as a process that has trained a while has it (no page
            # faults on every step for blocks a young process maps and unmaps): what the training after the forecast
            # runs in. The zoo GPT at 32 after the example's steps at 8: forecast +10.0 and +11.1 % without, -0.2
            # and -1.5 % with.
            torch.ops.gpucast.settle_c_allocator()
            self._warm_up()
            for i, (b, length) in enumerate(self.design, 1):
                self._probe(i, b, length)
            self._check()
            for b in _kernel_probes(self.timings, self.per_rank, self.target, self.probe_device, self.design):
                self._timing_probe(b)
                self.kernel_probes.append(b)
            self._reach()
            self._more_rounds()
            self._workspaces()
        finally:
            self.state.restore()
            self.progress.done()
        return self

    def _warm_up(self) -> None:
        """An untraced warm-up at the smallest probe size: lazy initialisations and caches of first calls (optimizer
        defaults, kernels' scratch) would otherwise make the first probe differ from the others."""
        warm = self.make_batch(*[x for x in self.design[0] if x is not None])
        if (_device_of(warm) == "meta") != self.meta:
            raise ValueError(_meta_mixed(not self.meta))
        for _ in range(self.iterations):
            try:
                self.step(warm)
            except (RuntimeError, NotImplementedError) as e:
                if self.meta:
                    raise _meta.refusal(e, self.model) from e
                if torch.is_grad_enabled() or not isinstance(e, RuntimeError):
                    raise
                raise RuntimeError(f"forecast: the training step failed with gradients disabled (forecast was "
                                   f"called under torch.no_grad() or torch.inference_mode(); call it outside "
                                   f"them): {e}") from e
        del warm
        self.state.restore()

    def _probe(self, i: int, b: int, length: int | None) -> None:
        """The i-th probe of the design: its memory trace, then (on the target) its steady timing."""
        what = f"batch {b}" + (f", length {length}" if length is not None else "")
        self.progress.show(f"probe {i} of {len(self.design)} ({what})")
        gc.collect()  # garbage freed during a probe would change what it records
        batch = self.make_batch(b) if length is None else self.make_batch(b, length)
        self.probe_device = _device_of(batch)
        t = self._memory_trace(batch)
        if length is None:
            self.forecaster.add_probe(t.result.handle, b)
            self.previous_probe = self.largest_probe
            self.largest_probe = t.result.handle  # the design is in increasing batch size
            self.probe_batches.append(b)
        else:
            self.forecaster.add_probe_seq(t.result.handle, b, length)
        structure = t.result.handle.iteration_timing(b)
        t = None  # the memory trace is not needed any more
        timed = _time_on_target(self.target, self.probe_device)
        if timed and min(self.time_fraction, self.time_budget) < 1.0 and self.timed_layers is None:
            # Sparse timing: the layers to time, chosen once on the first probe's structure; every timing trace
            # then takes device timers around those layers only.
            self.timed_layers = list(torch.ops.gpucast.choose_timed_layers(
                structure, float(self.time_fraction), time_budget=float(self.time_budget)))
        timing = (_steady_timing(self.step, batch, b, structure, self.timed_layers, model=self.model) if timed
                  else structure)
        self.timings.append(timing if length is None else _with_seq(timing, length))
        if timed:
            self.retime.append((b, length, structure))
        del batch, t
        self.state.restore()

    def _memory_trace(self, batch: Any):
        """`iterations` steps on `batch` under a memory trace (its wall time kept in probe_seconds): the trace."""
        t0 = time.perf_counter()
        with trace(model=self.model) as t:
            for _ in range(self.iterations):
                self.step(batch)
                mark_iteration_end()
        self.probe_seconds.append(time.perf_counter() - t0)
        return t

    def _check(self) -> None:
        """Memory probes beyond the design where the target lies beyond them (_CHECK_FACTOR): one at twice the
        largest, and if it allocates otherwise than the largest (a kernel changed between them), one at three times
        (at the target where that lies nearer), so that the allocations after the change have a line. Not for meta
        probes or a design over sequence lengths."""
        if self.meta or self.largest_probe is None or any(length is not None for _, length in self.design):
            return
        largest = self.probe_batches[-1]
        for factor in (_CHECK_FACTOR, _CHECK_AFTER):
            b = factor * largest if factor == _CHECK_FACTOR else min(factor * largest, self.per_rank)
            if self.per_rank < b or b <= self.probe_batches[-1]:
                return
            why = self._check_refused(b)
            if why:
                self.check_skipped = f"batch {b}: {why}"
                return
            before, before_batch = self.largest_probe, self.probe_batches[-1]
            try:
                self._memory_probe(b)
            except Exception as e:  # noqa: BLE001 - the probes so far still forecast: the check is left out
                self.check_skipped = f"batch {b}: the step failed there ({type(e).__name__}: {str(e)[:200]})"
                return
            try:
                diff = torch.ops.gpucast.probe_structure_difference(before, self.largest_probe, self.probe_device)
            except Exception as e:  # noqa: BLE001 - the probe joined; only the comparison is missing
                self.check_skipped = f"batch {b}: not compared with the batch-{before_batch} probe ({type(e).__name__})"
                return
            self.check_probes.append((b, before_batch, diff))
            if not diff:
                return

    def _check_refused(self, b: int) -> str:
        """Why a check probe at batch b does not run ("" where it does): its memory or its time."""
        try:
            from ._forecast import run_forecaster
            m = run_forecaster(self.forecaster, b, "cpu" if self.probe_device == "cpu" else self.target, 0, 0.9,
                               self.probe_device, "", self.state.own_ptrs())
        except Exception as e:  # noqa: BLE001 - no forecast at that batch: no probe there
            return f"no memory forecast there ({type(e).__name__})"
        if self.probe_device.startswith("cuda"):
            dev = torch.device(self.probe_device)
            free, _ = torch.cuda.mem_get_info(dev)
            if not _probe_fits(m.peak_reserved_bytes, free, torch.cuda.memory_reserved(dev)):
                return "its memory does not fit the device's free memory"
        else:
            free = _host_available_bytes()
            if free is None or m.peak_allocated_bytes > _REACH_MEMORY_SHARE * free:
                return "its memory does not fit this host's available memory"
        largest_s = self.probe_seconds[-1] if self.probe_seconds else 0.0
        estimate = largest_s * b / self.probe_batches[-1]
        if estimate > max(_CHECK_BUDGET_S, _CHECK_BUDGET_SHARE * sum(self.probe_seconds)):
            return f"it would take about {estimate:.0f} s"
        return ""

    def _memory_probe(self, b: int) -> None:
        """A memory-only probe at batch b: its trace joins the forecaster's probes, as the largest."""
        self.progress.show(f"check probe (batch {b})")
        gc.collect()
        try:
            batch = self.make_batch(b)
            t = self._memory_trace(batch)
            self.forecaster.add_probe(t.result.handle, b)
            self.previous_probe, self.largest_probe = self.largest_probe, t.result.handle
            self.probe_batches.append(b)
            del batch, t
        finally:
            self.state.restore()
            if self.probe_device.startswith("cuda"):
                torch.cuda.empty_cache()  # the probe's larger blocks are not the job's

    def _timing_probe(self, b: int) -> None:
        """A timing-only probe at batch b (its trace gives the first steps and the structure, as for the others)."""
        self.progress.show(f"timing probe (batch {b})")
        gc.collect()
        batch = self.make_batch(b)
        with trace(model=self.model) as t:
            for _ in range(self.iterations):
                self.step(batch)
                mark_iteration_end()
        structure = t.result.handle.iteration_timing(b)
        del t
        self.timings.append(_steady_timing(self.step, batch, b, structure, self.timed_layers, model=self.model))
        self.retime.append((b, None, structure))
        del batch
        self.state.restore()

    def _reach(self) -> None:
        """A timing probe nearer a target far beyond the probes (_reach_probes), where it fits on the device."""
        on_gpu = self.fits_on_device is not None and self.target != "cpu" and self.probe_device.startswith("cuda")
        fits = (lambda b: self.fits_on_device(self, b)) if on_gpu else None
        for b in _reach_probes(self.timings, self.per_rank, self.target, self.probe_device, self.design, fits):
            try:
                self._timing_probe(b)
            except torch.cuda.OutOfMemoryError:
                # The memory forecast said it fits; the device said otherwise (another process took memory since):
                # the forecast goes on without it.
                self.reach_skipped.append(b)
                self.state.restore()
                continue
            finally:
                if self.probe_device.startswith("cuda"):
                    torch.cuda.empty_cache()  # the probe's larger blocks are not the job's
            self.reach_probes.append(b)

    def _more_rounds(self) -> None:
        """Every timed probe timed again, round after round; each probe's timing the median over the rounds."""
        n_rounds = (self.timing_rounds if self.timing_rounds is not None
                    else _CPU_TIMING_ROUNDS if self.probe_device == "cpu" else 1)
        if len(self.retime) == len(self.timings) and n_rounds > 1:
            self.rounds = [list(self.timings)]
            for r in range(2, n_rounds + 1):
                timings = []
                for k, (b, length, structure) in enumerate(self.retime, 1):
                    self.progress.show(f"timing round {r} of {n_rounds}, probe {k} of {len(self.retime)} (batch {b})")
                    timings.append(_retimed(self.step, self.make_batch, b, length, structure, self.timed_layers,
                                            self.model, self.state))
                self.rounds.append(timings)
            self.timings = _round_median(self.rounds)

    def _workspaces(self) -> None:
        """The workspaces the target batch's kernels take, measured where the probes cannot show them."""
        if (self.largest_probe is not None and self.model is not None and self.target != "cpu"
                and self.probe_device.startswith("cuda") and self.conv_workspace is None):
            # cuDNN chooses again at the target batch: each convolution's workspace measured there.
            from . import _conv_workspace
            calls = _conv_workspace.conv_calls(self.largest_probe)
            if calls:
                ws, self.conv_skipped = _conv_workspace.measure_quietly(self.model, calls, self.per_rank,
                                                                        self.probe_device)
                if ws:
                    self.forecaster.set_conv_workspaces(ws)
        if (self.target == "cpu" and self.probe_device == "cpu" and self.previous_probe is not None
                and self.probe_batches[-1] != self.probe_batches[-2] and self.tp == 1):
            # The CPU kernels size a matrix multiply's scratch by their blocking of the problem: each call's
            # measured at the target batch (under tensor parallelism the calls are split: not measured).
            from . import _op_workspace
            ws, self.op_skipped = _op_workspace.measure_quietly(self.largest_probe, self.previous_probe,
                                                                self.probe_batches[-1], self.probe_batches[-2],
                                                                self.per_rank)
            if ws:
                self.forecaster.set_op_workspaces(ws, self.per_rank)
