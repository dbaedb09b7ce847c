"""gpucast.forecast(): probe a training step at small batch sizes, forecast the whole run.

Python runs the probes (_probes.py: it owns the step function, the batches and the state to restore); the forecast
itself is C++ (torch.classes.gpucast.MemoryForecaster, torch.ops.gpucast.forecast_step_time); _results.py holds
what it returns.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from . import _ranks
from ._errors import error_code
from ._notes import note
from ._warnings import warn
from ._probes import (_REACH, _REACH_BUDGET_S, _REACH_MEMORY_SHARE, ProbeRun, _probe_fits, _State)
from ._results import Forecast, MemoryForecast, TimeForecast
from ._settings import (env_text, _buffer_bytes, _correction, _default_link, _format_link, _format_parallel, _gpu_pricing,
                        _module_paths, _note_default_link, _optimizer_list, _optimizer_name, _prior, _time_on_target)


def run_forecaster(forecaster: Any, batch: int, target: str, capacity: int, safety: float, probe_device: str,
                   parallel: str, exclude: list, conv_workspace: int = -1, moe_skew: float = 1.0) -> MemoryForecast:
    """MemoryForecaster.run with the settings PyTorch takes from the environment, read as PyTorch reads them:
    PYTORCH_ALLOC_CONF (else PYTORCH_CUDA_ALLOC_CONF), CUBLAS_WORKSPACE_CONFIG and CUDNN_CONV_WSCAP_DBG."""
    alloc_conf = env_text("PYTORCH_ALLOC_CONF") or env_text("PYTORCH_CUDA_ALLOC_CONF")
    text = forecaster.run(target_batch=batch, target=target, capacity_bytes=capacity, safety_fraction=safety,
                          probe_device=probe_device, parallel=parallel, alloc_conf=alloc_conf,
                          cublas_workspace_config=env_text("CUBLAS_WORKSPACE_CONFIG"), exclude=exclude,
                          conv_workspace=conv_workspace, cudnn_conv_wscap=env_text("CUDNN_CONV_WSCAP_DBG"),
                          moe_skew=float(moe_skew))
    return MemoryForecast(**json.loads(text))


def forecast(step: Callable[[Any], Any], make_batch: Callable[[int], Any], batch_size: int, *,
             model: torch.nn.Module | None = None,
             optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
             target: str = "cpu", parallel: dict | None = None, probe_batch_sizes: Iterable[int] = (2, 4, 8),
             capacity: int | None = None, safety_fraction: float = 0.9, iterations: int = 2,
             seq_len: int | None = None, probe_seq_lens: Iterable[int] | None = None,
             link: dict | str | None = None, time_fraction: float = 1.0, time_budget: float = 1.0,
             gnn: str | None = "", conv_workspace: int | None = None,
             timing_rounds: int | None = None, moe_skew: float = 1.0) -> Forecast:
    """Forecast the run's memory at `batch_size` on `target` from probes at small batch sizes.

    step(batch) runs one full training iteration; make_batch(n) returns a batch of n samples. Each probe
    traces `iterations` iterations (2: the first, which creates optimizer state, and a steady one). With
    `model` and `optimizer`, their state (and the RNG's) is restored after the probes; without them, a
    warning says that the probes changed it. A step that runs several optimizers (one for some parameters,
    another for the rest) takes them all as a list: optimizer=[opt_a, opt_b]; steps with no backward pass
    between them are one iteration's optimizer. `target` is "cpu" (this host's CPU allocator bytes) or a
    GPU from gpucast.devices(); `capacity` overrides its memory in bytes, and with it any other name is a GPU of that
    capacity (an unknown name without it raises ValueError listing the names, before any probe runs). `parallel` is
    dict(dp=, tp=, pp=, dp_mode="ddp"|"zero1"|"zero2"|"fsdp", micro_batches=), and for the step time
    gradient_as_bucket_view=, broadcast_buffers=, buffer_bytes=, bucket_cap_mb= (DDP), fsdp_units= (the modules
    fully_shard is called on: modules of `model`, module classes or class names, or module paths such as
    "GPT.blocks.0"; with them the memory forecast follows FSDP2 rank by rank, without them every layer with
    parameters is a unit and the memory is a coarse bound) and reshard_after_forward= (True, False or a number of
    ranks); `batch_size` is global. fc.memory.per_rank lists each group of data-parallel ranks that hold alike.
    Under gpucast.simulated_ranks(world_size, rank) the probes run as that rank of a job built inside it (DTensor,
    parallelize_module, fully_shard on a fake process group): its memory is forecast as traced, no parallel rule
    applied, and `parallel` must describe a world of world_size.
    PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF and CUBLAS_WORKSPACE_CONFIG are read as PyTorch reads them.
    For a GPU target from CPU probes, convolutions run on cuDNN, whose workspace per call is chosen on the GPU:
    `conv_workspace` (bytes) models one at every convolution; without it CUDNN_CONV_WSCAP_DBG's cap (MiB) is
    modelled when set, else none, and fc.memory.conv_workspace_headroom_allocated_bytes / _reserved_bytes say
    how large each may be before the forecast peaks change. With probes on the target's GPU and `model`, cuDNN
    chooses again at the target batch: each torch.nn.ConvNd the probes called is run alone there (zero inputs of
    the probes' shape at the per-rank batch, forward and, where the probes ran it, backward) under a memory
    trace, and its workspace replaces the probes' (fc.memory.conv_calls_measured; `conv_workspace` skips this).
    Routed layers (mixture of experts: experts chosen per token) are found in the probes and sized by the tokens
    each expert receives: fc.memory.peak_* are the bound in which each layer's k most-loaded experts receive
    `moe_skew` of its tokens (1.0, the default: all of them, the heaviest routing without a capacity factor), and
    fc.memory.moe holds that bound beside the peak with the tokens spread evenly over the experts.

    Step time (fc.time) for a GPU target from CPU probes is priced, layer by layer, from the probes' work (FLOPs
    and bytes per op kind and precision) at the GPU's rates in gpucast's table (gpucast.gpu_rates(): efficiencies
    fitted on per-operator latencies measured on real GPUs; TF32 as torch.backends allows it), then fitted over
    the batch with the communication of `parallel` as below; per_layer[i]["source"] is "gpu-table".
    Step time is measured when the probes ran on the target itself (target "cpu" with CPU batches):
    per-layer fits over the probes' timings (each probe's step timed in steady state after its memory trace:
    one warm-up and three timed iterations untraced, then the element-wise median of 3 to 9 light traces, as
    many as take about 0.1 s: no shapes, no memory events; FLOPs, bytes and the layer graph from the probe's
    full trace; with timing_rounds > 1, every timed probe is timed so again after the last, round after round, and
    each layer's time is the median over the rounds: None, 3 rounds where the probes ran on the CPU, whose speed
    drifts from second to second on a shared host, 1 on a GPU; fc.timing_rounds holds each round's timings),
    evaluated at each rank's micro-batch (each layer on the probes that ran the largest probe's
    kernels; where the probes' convolutions took PyTorch's CPU im2col path, which it leaves at batch 16, timing-only probes at 16 and 24
    are added so that those layers are timed on the kernels the target runs; where the per-rank target is more
    than 3 times the largest probe, a timing-only probe at half of it is added when the probes forecast
    its step under 1 s), and the communication of `parallel` (DDP / ZeRO buckets overlapped with backward, FSDP
    gathers with prefetch, tensor-parallel all-reduces, the 1F1B pipeline and its bubble) over `link`: what
    gpucast.calibrate() returns (alpha_us, bytes_per_us), or the topology in the configuration grammar, e.g.
    "intra:nvlink4,gpus_per_node:8,inter:ib-ndr" (names from gpucast.interconnects()); without it, a GPU
    target's usual node (gpucast.devices()'s default_link, and a note says so). With time_fraction < 1
    only that fraction of the layers is timed (stratified by kind, D-optimal over FLOPs, bytes and ops within
    each kind, chosen on the first probe's structure; its timing traces take device timers around those layers
    only: timed_layers of gpucast.trace) and keeps its measured times; the others are predicted by per-kind
    roofline models fitted on them (per_layer[i]["source"]; fc.time.timed_layers counts the timed ones).
    time_budget < 1 bounds the timed layers' share of the iteration's layer time instead, or as well (their
    times in the first probe's full trace): the largest design within it.
    The graph network (ScaleDL's alpha and beta) then corrects the step on target "cpu": `gnn` is a weights
    file ("" the shipped one; None: no correction); fc.time.alpha, beta, correction, uncorrected_step_ms.

    With `seq_len`, sizes are also scaled by sequence length: make_batch(n, length) then returns n samples of
    that length, and the probes cover probe_seq_lens (default: seq_len/4, seq_len/2, seq_len) at the smallest
    batch sizes (six probes for three batch sizes and three lengths). Step times are then fitted per layer as
    a + c·b·L + d·b·L² over the probes (tokens, and attention's pairs of tokens; a, c, d >= 0), without the graph
    network's correction (trained at fixed lengths); fc.step_time(batch, seq_len=...) forecasts other lengths.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"forecast: batch_size must be an integer of at least 1, got {batch_size!r}")
    probes = tuple(probe_batch_sizes)
    design = _probe_design(probes, seq_len, probe_seq_lens)
    for name, value in (("time_fraction", time_fraction), ("time_budget", time_budget)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ValueError(f"forecast: {name} must be a number in (0, 1], got {value!r}")
    if iterations not in (1, 2):
        raise ValueError(f"forecast: iterations must be 1 or 2, got {iterations!r}")
    if timing_rounds is not None and (isinstance(timing_rounds, bool) or not isinstance(timing_rounds, int)
                                      or timing_rounds < 1):
        raise ValueError(f"forecast: timing_rounds must be an integer of at least 1 (or None), got {timing_rounds!r}")
    _check_memory_args("forecast", capacity, moe_skew)
    # Before any probe runs: cpu, a device table name, or with a capacity any GPU's name (the plugin's one rule).
    target = torch.ops.gpucast.check_target(str(target), capacity or 0)
    modules = _module_paths(model)
    parallel = _with_traced_rank(parallel)
    parallel_text = _format_parallel(parallel, modules=modules)
    # Checked before the probes run (errors name the key): each rank's batch for what is measured at the target.
    per_rank, tp = _per_rank_batch("forecast", parallel_text, batch_size)
    if conv_workspace is not None and (isinstance(conv_workspace, bool) or not isinstance(conv_workspace, int)
                                       or conv_workspace < 0):
        raise ValueError(f"forecast: conv_workspace must be a number of bytes of at least 0, got {conv_workspace!r}")

    meta = _on_meta(model, target)
    optimizers = _optimizer_list(optimizer)
    state = _State(model, optimizers)
    if model is None or not optimizers:
        warn("gpucast.forecast: the probes ran training steps and changed the model's and optimizer's "
                      "state; pass model= and optimizer= to have them restored")
    run = ProbeRun(step, make_batch, model=model, state=state, design=design, iterations=iterations, target=target,
                   per_rank=per_rank, tp=1 if _traced(parallel) else tp, time_fraction=float(time_fraction), time_budget=float(time_budget),
                   timing_rounds=timing_rounds, conv_workspace=conv_workspace,
                   fits=_fits_on_device(target, float(safety_fraction), state, conv_workspace), meta=meta).run()
    probe_device, timings, forecaster = run.probe_device, run.timings, run.forecaster
    cap = int(capacity) if capacity is not None else 0
    if seq_len is not None:
        forecaster.set_target_seq(seq_len)
    traced = {k: parallel[k] for k in ("traced_world", "traced_rank") if k in parallel}
    pricer = _MemoryPricer(forecaster, run, state.own_ptrs(), conv_workspace, modules, optimizers, iterations,
                           float(safety_fraction), float(moe_skew), target, capacity, traced)
    memory = run_forecaster(forecaster, batch_size, target, cap, float(safety_fraction), probe_device, parallel_text,
                            pricer.exclude, pricer.conv_workspace, moe_skew)
    _memory_notes(memory, pricer.facts)
    for w in memory.warnings:
        warn(f"gpucast.forecast: {w['text']}")
    context = json.loads(torch.ops.gpucast.context())
    buffer_bytes = _buffer_bytes(model)
    time_fc = _forecast_time(timings, batch_size, target, probe_device, parallel or {}, link,
                             time_fraction=time_fraction, optimizer_name=_optimizer_name(optimizer), gnn=gnn,
                             seq_len=seq_len, buffer_bytes=buffer_bytes, modules=modules)
    if time_fc is not None:
        _probe_notes(time_fc, run)
    fc = Forecast(memory=memory, probe_batch_sizes=tuple(sorted(set(probes))), probe_device=probe_device,
                  context=context, time=time_fc, timings=timings if time_fc is not None else [],
                  timing_rounds=run.rounds if time_fc is not None else [], target=target,
                  optimizer_name=_optimizer_name(optimizer), seq_len=seq_len, buffer_bytes=buffer_bytes,
                  modules=modules, traced=traced, _pricer=pricer)
    from . import trackers
    trackers.publish(fc)
    return fc


def _per_rank_batch(caller: str, parallel_text: str, batch_size: int) -> tuple[int, int]:
    """(each rank's micro-batch, tp) of a global batch under a parallel configuration; ValueError naming the key
    (torch.ops.gpucast.check_parallel) or the batch that the data-parallel ranks and micro-batches cannot share."""
    dp, tp, _, micro_batches = torch.ops.gpucast.check_parallel(parallel_text)
    if batch_size < dp * micro_batches:
        raise ValueError(f"{caller}: batch_size {batch_size} is smaller than dp x micro_batches = "
                         f"{dp * micro_batches}: every rank needs a sample in every micro-batch")
    if batch_size % (dp * micro_batches):
        raise ValueError(f"{caller}: parallel dp={dp} x micro_batches={micro_batches} does not divide batch_size "
                         f"{batch_size}: the ranks would hold {batch_size // (dp * micro_batches)} and "
                         f"{batch_size // (dp * micro_batches) + 1} samples per micro-batch; give a batch_size that "
                         f"is a multiple of {dp * micro_batches}")
    return max(1, batch_size // (dp * micro_batches)), tp


def _check_memory_args(caller: str, capacity: Any, moe_skew: Any) -> None:
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
        raise ValueError(f"{caller}: capacity must be a number of bytes of at least 1 (or None), got {capacity!r}")
    if isinstance(moe_skew, bool) or not isinstance(moe_skew, (int, float)) or not 0 < moe_skew <= 1:
        raise ValueError(f"{caller}: moe_skew must be a number in (0, 1], got {moe_skew!r}")


class _MemoryPricer:
    """The probes' traces (the C++ forecaster) and what a memory forecast from them needs besides the target, kept
    so that Forecast.memory_at prices another batch, GPU or parallel layout without probing again. It holds no
    reference to the model or the optimizers: module paths, ints and the probe runner's findings only."""

    def __init__(self, forecaster: Any, run: ProbeRun, exclude: list, conv_workspace: int | None, modules: dict,
                 optimizers: list, iterations: int, safety_fraction: float, moe_skew: float, target: str,
                 capacity: int | None, traced: dict):
        self.forecaster, self.probe_device, self.exclude = forecaster, run.probe_device, exclude
        self.conv_workspace = -1 if conv_workspace is None else conv_workspace
        self.modules = modules  # paths by module id and class, as Forecast.modules (no module held)
        self.facts = _ProbeFacts(run, optimizers, iterations)
        self.safety_fraction, self.moe_skew = safety_fraction, moe_skew
        self.target, self.capacity = target, capacity  # the forecast's own, kept where memory_at names no target
        self.traced = traced  # under simulated_ranks: the rank traced, kept in every layout (as step_time keeps it)

    def __call__(self, batch_size: int, target: str | None, parallel: dict | None, capacity: int | None,
                 safety_fraction: float | None, moe_skew: float | None) -> MemoryForecast:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"memory_at: batch_size must be an integer of at least 1, got {batch_size!r}")
        moe = self.moe_skew if moe_skew is None else moe_skew
        _check_memory_args("memory_at", capacity, moe)
        safety = self.safety_fraction if safety_fraction is None else float(safety_fraction)
        if target is None:
            target, capacity = self.target, self.capacity if capacity is None else capacity
        target = torch.ops.gpucast.check_target(str(target), capacity or 0)
        if target == "cpu" and self.probe_device == "meta":
            raise ValueError("memory_at: probes on the meta device forecast a GPU target, not 'cpu'")
        if parallel is not None and not isinstance(parallel, dict):
            raise TypeError(f"memory_at: parallel expects a dict such as dict(dp=8, dp_mode='ddp'), got "
                            f"{type(parallel).__name__}")
        parallel = {**(parallel or {}), **self.traced} if self.traced else parallel
        text = _format_parallel(parallel, modules=self.modules)
        _per_rank_batch("memory_at", text, batch_size)
        memory = run_forecaster(self.forecaster, batch_size, target, int(capacity or 0), safety, self.probe_device,
                                text, self.exclude, self.conv_workspace, moe)
        _memory_notes(memory, self.facts)
        return memory


class _ProbeFacts:
    """What the probe runner added or could not measure, as the memory notes tell it (no reference to the run)."""

    def __init__(self, run: ProbeRun, optimizers: list, iterations: int):
        self.check_probes, self.check_skipped = list(run.check_probes), run.check_skipped
        self.op_skipped, self.conv_skipped = list(run.op_skipped), list(run.conv_skipped)
        self.lbfgs_history = [o.param_groups[0].get("history_size", 100) for o in optimizers
                              if isinstance(o, torch.optim.LBFGS)]
        self.iterations = iterations


def _on_meta(model: torch.nn.Module | None, target: str) -> bool:
    """Whether the probes run on the meta device (the model's parameters and buffers there); ValueError for a model
    partly there, or for target "cpu" (meta probes forecast a GPU)."""
    if not isinstance(model, torch.nn.Module):
        return False
    where = {t.is_meta for t in (*model.parameters(), *model.buffers())}
    if where == {True, False}:
        raise ValueError("forecast: some of the model's parameters or buffers are on the meta device and some are "
                         "not; build the whole model on meta (with torch.device('meta'): ...) or on the CPU")
    if True not in where:
        return False
    if target == "cpu":
        raise ValueError("forecast: probes on the meta device forecast a GPU target (target='H100-80GB', ...); "
                         "target 'cpu' is forecast from probes on the CPU")
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.RNNBase):
            # aten::lstm is composite: on meta it runs step by step (a matrix multiply and its gates per time step),
            # where the CPU runs oneDNN's fused layer and a GPU cuDNN's: other memory and other work.
            raise ValueError(f"forecast: {type(m).__name__} {name!r} runs step by step on the meta device where the "
                             f"CPU and the GPU run one fused kernel, so its memory is not forecast from meta "
                             f"probes yet; probe it on the CPU (at a smaller size) or on the GPU")
    return True


def _traced(parallel: dict) -> bool:
    """Whether `parallel` says the probes ran as one rank (traced_world > 0)."""
    return int(parallel.get("traced_world", 0) or 0) > 0


def _with_traced_rank(parallel: dict | None) -> dict:
    """`parallel` with traced_world and traced_rank added under gpucast.simulated_ranks (the probes run as that
    rank: its memory is forecast as traced, not rewritten by a parallel rule)."""
    if parallel is not None and not isinstance(parallel, dict):
        return parallel  # _format_parallel names the type
    parallel = dict(parallel or {})
    traced = _ranks.traced_rank()
    if traced is not None:
        parallel.setdefault("traced_world", traced[0])
        parallel.setdefault("traced_rank", traced[1])
    return parallel


def _probe_design(probes: tuple, seq_len: int | None, probe_seq_lens: Iterable[int] | None) -> list:
    """The probes' (batch, length) pairs in increasing batch size (length None without seq_len); ValueError naming
    the argument for sizes forecast() cannot take."""
    if not probes or any(not isinstance(b, int) or b < 1 for b in probes):
        raise ValueError(f"forecast: probe_batch_sizes must be integers of at least 1, got {probes!r}")
    design = [(b, None) for b in sorted(set(probes))]
    if seq_len is not None:
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"forecast: seq_len must be an integer of at least 1, got {seq_len!r}")
        lens = tuple(sorted(set(probe_seq_lens or (max(1, seq_len // 4), max(1, seq_len // 2), seq_len))))
        if len(lens) < 3 or any(not isinstance(x, int) or x < 1 for x in lens):
            raise ValueError(f"forecast: probe_seq_lens must be at least 3 distinct integers >= 1, got {lens!r}")
        bs = sorted(set(probes))
        if len(bs) < 3:
            raise ValueError(f"forecast: scaling by sequence length needs 3 probe batch sizes, got {tuple(bs)!r}")
        # Every batch size at the shortest length, every length at the smallest batch, and one cross point.
        design = sorted({(b, lens[0]) for b in bs} | {(bs[0], x) for x in lens} | {(bs[1], lens[-1])})
    return design


def _fits_on_device(target: str, safety_fraction: float, state: _State, conv_workspace: int | None):
    """(run, b) -> whether a GPU timing probe at batch b fits what the device holds now (its memory forecast from
    the probes so far)."""
    def fits(run: ProbeRun, b: int) -> bool:
        try:
            m = run_forecaster(run.forecaster, b, target, 0, safety_fraction, run.probe_device, "",
                               state.own_ptrs(), -1 if conv_workspace is None else conv_workspace)
            dev = torch.device(run.probe_device)
            free, _ = torch.cuda.mem_get_info(dev)
            return _probe_fits(m.peak_reserved_bytes, free, torch.cuda.memory_reserved(dev))
        except Exception:  # no memory forecast at that batch: no probe there
            return False
    return fits


def _memory_notes(memory: MemoryForecast, run: "_ProbeFacts") -> None:
    """What the probe runner added or could not measure, and the optimizers whose state grows beyond the probes."""
    for b, before, diff in run.check_probes:
        if diff:
            memory.notes.append(note("kernel-change", f"the memory probe at batch {b}, nearer the target, allocates "
                                                      f"otherwise than the batch-{before} probe ({diff}): a kernel "
                                                      f"changed between them; the forecast is sized from the probes "
                                                      f"after the change where their allocations differ"))
        else:
            memory.notes.append(note("check-probe", f"a memory probe at batch {b}, nearer the target, allocates as the "
                                                    f"batch-{before} probe does: it joins the probes"))
    if run.check_skipped:
        memory.notes.append(note("check-probe-skipped", f"no memory probe nearer the target ({run.check_skipped}): "
                                                        f"a kernel that allocates otherwise beyond the probes would "
                                                        f"not be seen"))
    if run.op_skipped:
        more = len(run.op_skipped) - 3
        shown = ", ".join(run.op_skipped[:3]) + (f" and {more} more" if more > 0 else "")
        memory.notes.append(note("op-workspace-unmeasured", f"matrix multiplies: scratch not measured at the target "
                                                            f"batch for {shown}: the probes', scaled, is kept for "
                                                            f"those calls"))
    if run.conv_skipped:
        memory.notes.append(note("conv-workspace-unmeasured",
                                 f"cuDNN: workspaces not measured at the target batch for "
                                 f"{', '.join(run.conv_skipped)}: the probes' are kept for those calls"))
    for size in run.lbfgs_history:
        memory.warnings.append(note(
            "lbfgs-history", f"LBFGS keeps the directions of up to {size} past updates (history_size), one more "
                             f"pair each inner iteration: its state grows over the run's first steps beyond what "
                             f"the probes' {run.iterations} iteration(s) held, and the forecast peak leaves that "
                             f"growth out"))


def _probe_notes(tf: TimeForecast, run: ProbeRun) -> None:
    """The timing-only probes the runner added, or skipped, first in the step time's notes."""
    if run.kernel_probes:
        tf.notes.insert(0, note("im2col-probes",
                                f"the probes ran convolutions on PyTorch's CPU im2col path (1x1, stride-1 kernels on "
                                f"one thread below batch 16), the target batch runs them through mkldnn: timing probes "
                                f"at batch {', '.join(map(str, run.kernel_probes))} added, and those layers fitted on "
                                f"them"))
    if run.reach_skipped:
        tf.notes.insert(0, note("reach-probe-skipped",
                                f"a timing probe at batch {run.reach_skipped[0]} ran out of device memory and was "
                                f"left out: the fits extrapolate from the largest probe"))
    if run.reach_probes:
        on_gpu = (f", its forecast memory within {_REACH_MEMORY_SHARE:.0%} of what the device can hold"
                  if run.probe_device.startswith("cuda") else "")
        tf.notes.insert(0, note("reach-probe",
                                f"the target batch is more than {_REACH:g} times the largest probe: a timing probe at "
                                f"batch {run.reach_probes[0]} added (its forecast step under {_REACH_BUDGET_S:g} s"
                                f"{on_gpu}), so that the fits extrapolate 2 times at most"))


def _forecast_time(timings: list, batch_size: int, target: str, probe_device: str, parallel: dict,
                   link: dict | str | None, time_scale: float = 1.0, time_fraction: float = 1.0,
                   optimizer_name: str = "other", gnn: str | None = "",
                   seq_len: int | None = None, buffer_bytes: int = 0,
                   modules: dict | None = None) -> TimeForecast | None:
    """The step time from the probes' timings where the probes ran on the target; for a GPU target from CPU
    probes, priced from the GPU rates table (None, with a warning, where the table has no such GPU)."""
    pricing = _gpu_pricing(target, probe_device)
    if not timings or not (pricing or _time_on_target(target, probe_device)):
        return None
    if _traced(parallel) and (int(parallel.get("pp", 1)) > 1 or int(parallel.get("dp", 1)) > 1):
        warn("gpucast.forecast: the probes ran as one rank of a data-parallel or pipelined job (simulated ranks): "
             "its memory is forecast, its step time is not yet (the probes' own hooks, shards and collectives are "
             "not told apart from what the step-time model adds)")
        return None
    prior_flops, prior_bytes = _prior(target, time_fraction, timings)

    def run(rates: dict) -> str:
        return torch.ops.gpucast.forecast_step_time(
            timings, int(batch_size), parallel=_format_parallel(parallel, buffer_bytes, modules),
            link=_format_link(_default_link(link, target)), time_scale=float(time_scale),
            time_fraction=float(time_fraction), prior_flops_per_s=prior_flops, prior_bytes_per_s=prior_bytes,
            **rates, seq_len=int(seq_len or 0), **_correction(target, optimizer_name, gnn, seq_len))
    try:
        text = run(pricing)
    except (ValueError, RuntimeError) as e:
        if not isinstance(e, ValueError):  # gpucast's own fault, not the input's: the memory forecast stands
            warn(f"gpucast.forecast: the step-time forecast failed ({type(e).__name__}: {e}); no step "
                          f"time, the memory forecast stands")
            return None
        if not pricing or error_code(e) != "gpu-rates":
            raise
        # A table of the user's (GPUCAST_GPU_RATES) that cannot be used: the shipped one, said aloud.
        shipped = Path(torch.ops.gpucast.gpu_rates_path(True))
        text = None
        if os.environ.get("GPUCAST_GPU_RATES") and shipped.is_file():
            try:
                text = run({**pricing, "gpu_rates": str(shipped)})
                warn(f"gpucast.forecast: GPUCAST_GPU_RATES could not be used for {target} ({e}); the step "
                              f"time is priced from the shipped table {shipped}")
            except (ValueError, RuntimeError):
                text = None
        if text is None:
            warn(f"gpucast.forecast: no step time for {target}: {e}")
            return None
    tf = TimeForecast(**json.loads(text))
    _note_default_link(tf, link, target)
    if not tf.per_layer:
        msg = ("no layer ran outside the optimizer's step: an optimizer that takes a closure (LBFGS) runs the "
               "forward and backward inside its step, whose time is then the optimizer's, the time of the probe "
               "nearest the batch in size, not scaled to the batch")
        tf.notes.insert(0, note("layers-in-optimizer", msg))
        warn(f"gpucast.forecast: {msg}")
    if probe_device not in ("cpu", "meta") and any(json.loads(t).get("clock") == "cpu" for t in timings):
        # No device timer recorded the probes' kernels (the trace's notes say why): their host clocks measure
        # the launches, which on a GPU neither scale with the batch nor add up to the kernels' time.
        msg = (f"the probes on {probe_device} carry host clock times only (no device timer recorded their "
               f"kernels; see the trace's notes): the step time measures launches, not the kernels, and does not "
               f"scale with the batch as the GPU's work does")
        tf.notes.insert(0, note("host-clocks-only", msg))
        warn(f"gpucast.forecast: {msg}")
    return tf
