"""gpucast.forecast(): probe a training step at small batch sizes, forecast the whole run.

Python runs the probes (it owns the step function, the batches and the state to restore); the forecast
itself is C++ (torch.classes.gpucast.MemoryForecaster).
"""
from __future__ import annotations

import copy
import gc
import json
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from ._errors import error_code
from ._trace import _flatten, mark_iteration_end, trace

SCHEMA_VERSION = 1


def interconnects() -> list[dict]:
    """The interconnect table (names for forecast(link="intra:...,inter:...")): alpha_us, bytes_per_us."""
    return json.loads(torch.ops.gpucast.interconnects())


def gpu_rates(path: str = "") -> list[dict]:
    """The GPU rates table that prices a GPU target's step from CPU probes: per GPU its peaks, what the
    efficiencies were fitted on, and per kind of op and pass the share of peak FLOP/s and bandwidth its kernels
    reach and the cost per kernel. path: another table in the same format ("": the shipped one, or
    $GPUCAST_GPU_RATES)."""
    return json.loads(torch.ops.gpucast.gpu_rates(str(path)))["gpus"]


def devices() -> list[dict]:
    """The documented device table: name, capacity_bytes, compute_capability, context_bytes, source, default_link
    (the GPU's usual node in the link grammar, assumed for parallel forecasts without link=)."""
    rows = []
    for line in torch.ops.gpucast.device_table().splitlines():
        name, cap, cc, ctx, source, default_link = line.split("\t")
        rows.append({"name": name, "capacity_bytes": int(cap), "compute_capability": int(cc) / 10,
                     "context_bytes": int(ctx), "source": source, "default_link": default_link})
    return rows


def _link_keys() -> tuple:
    """The link configuration's keys, in order (the C++ registry: comm_model.h's link_config_keys)."""
    return tuple(torch.ops.gpucast.link_keys())


# What gpucast.calibrate() returns beside the link: it describes the measurement, the forecast does not read it.
_CALIBRATE_INFO_KEYS = ("backend", "cores", "local_ranks", "threads")


def _default_link(link: dict | str | None, target: str) -> dict | str | None:
    """link, or where none is given for a GPU target, that GPU's usual node from the device table."""
    if link is not None or target == "cpu":
        return link
    for d in devices():
        if d["name"].lower() == target.lower():
            return d["default_link"] or None
    return None


def _note_default_link(tf: "TimeForecast", link: dict | str | None, target: str, stacklevel: int = 3) -> None:
    used = _default_link(link, target)
    if link is None and used and tf.dp * tf.tp * tf.pp > 1:
        tf.notes.insert(0, note("default-link", f"link: {target}'s usual node assumed ({used}, the device table's "
                                                f"default); pass link= (gpucast.calibrate() on the job's process "
                                                f"group, or a topology) for another"))
    if not used and tf.dp * tf.tp * tf.pp > 1:
        warnings.warn(f"gpucast.forecast: no link is known for target '{target}', so the step's collectives "
                      f"(dp={tf.dp}, tp={tf.tp}, pp={tf.pp}) are left out of it; pass link=gpucast.calibrate() "
                      f"(run on the job's process group) or a topology such as 'intra:nvlink4,gpus_per_node:8'",
                      stacklevel=stacklevel)


def _format_link(link: dict | str | None) -> str:
    """The link configuration text from what gpucast.calibrate() returns (its other keys are ignored), a dict of
    topology keys, or the text itself."""
    if link is None:
        return ""
    if isinstance(link, str):
        return link
    if not isinstance(link, dict):
        raise TypeError(f"link: expected a dict (what gpucast.calibrate() returns) or a text such as "
                        f"'intra:nvlink4,gpus_per_node:8', got {type(link).__name__}")
    link_keys = _link_keys()
    if not any(k in link for k in link_keys):
        raise ValueError("forecast: link should hold alpha_us and bytes_per_us (what gpucast.calibrate() returns) "
                         f"or topology keys ({', '.join(link_keys)}), got {link!r}")
    unknown = [k for k in link if k not in link_keys and k not in _CALIBRATE_INFO_KEYS]
    if unknown:
        raise ValueError(f"forecast: link: unknown key{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(repr(k) for k in unknown)}; known: {', '.join(link_keys)} (and what "
                         f"gpucast.calibrate() also returns: {', '.join(_CALIBRATE_INFO_KEYS)})")
    def text(k, v):
        # What calibrate() returns: [{"bytes":, "us":}, ...] and [{"bytes":, "factor":}, ...].
        second = {"samples": "us", "late_samples": "us", "memory_contention_samples": "factor",
                  "ddp_overhead_samples": "us", "send_samples": "us", "all_gather_samples": "us",
                  "reduce_scatter_samples": "us"}.get(k)
        if second and isinstance(v, (list, tuple)):
            try:
                return ";".join(f"{float(x['bytes']):.17g}/{float(x[second]):.17g}" for x in v)
            except (TypeError, KeyError, ValueError) as e:
                raise ValueError(f"link: '{k}' should be a list of {{'bytes': ..., '{second}': ...}} as "
                                 f"gpucast.calibrate() returns, got {v!r}") from e
        if isinstance(v, bool):
            return "True" if v else "False"
        return v
    keys = [k for k in link_keys if k in link]
    if "alpha_us" not in keys and "intra" not in keys:  # samples refine an intra-node link; alone they are not one
        keys = [k for k in keys if k not in ("samples", "send_samples")]
    if "samples" not in keys:  # the rank count, the idle spells and the other collectives go with the samples
        keys = [k for k in keys if k not in ("ranks", "samples_gap_us", "late_samples", "late_gap_us",
                                             "all_gather_samples", "reduce_scatter_samples")]
    return ",".join(f"{k}:{text(k, link[k])}" for k in keys)


def _format_parallel(parallel: dict | None, buffer_bytes: int = 0, modules: dict | None = None) -> str:
    """The parallel configuration text; buffer_bytes (the model's buffers, which DDP broadcasts every step) is
    added where the caller did not give it; fsdp_units resolved to module paths by `modules` (_module_paths)."""
    if not parallel:
        return ""
    if not isinstance(parallel, dict):
        raise TypeError(f"parallel: expected a dict such as dict(dp=8, dp_mode='ddp'), got {type(parallel).__name__}")
    out = []
    for k, v in parallel.items():
        if isinstance(v, bool):
            v = "True" if v else "False"
        elif k == "fsdp_units":
            v = _unit_paths(v, modules or {})
        out.append(f"{k}:{v}")
    if buffer_bytes > 0 and "buffer_bytes" not in parallel:
        out.append(f"buffer_bytes:{buffer_bytes}")
    return ",".join(out)


def _module_paths(model) -> dict:
    """The model's modules as gpucast's trace names them: {"paths": {id(module): path}, "classes": {class name:
    [paths]}, "root": the root's path}; empty without a model."""
    if model is None or not isinstance(model, torch.nn.Module):
        return {}
    root = type(model).__name__
    paths, classes = {}, {}
    for n, m in model.named_modules():
        path = f"{root}.{n}" if n else root
        paths[id(m)] = path
        classes.setdefault(type(m).__name__, []).append(path)
    return {"paths": paths, "classes": classes, "root": root}


def _unit_paths(units, modules: dict) -> str:
    """parallel's fsdp_units as the configuration's '|'-joined module paths. Each item: a module of the model, a
    module class or its name (every module of that class is a unit, as PyTorch's ModuleWrapPolicy wraps them), or
    a module path as gpucast names it ("GPT.blocks.0"; its root class alone: the root unit only). A string with
    '|' is taken as the paths themselves."""
    if isinstance(units, str) and "|" in units:
        return units
    items = [units] if isinstance(units, (str, type, torch.nn.Module)) else units
    try:
        items = list(items)
    except TypeError:
        raise TypeError(f"parallel: 'fsdp_units' expects modules, module classes, class names or module paths (one "
                        f"or a list), got {type(units).__name__}") from None
    classes, paths = modules.get("classes", {}), []
    for u in items:
        if isinstance(u, torch.nn.Module):
            if id(u) not in modules.get("paths", {}):
                raise ValueError(f"parallel: 'fsdp_units' holds a {type(u).__name__} that is not a module of the "
                                 f"forecast's model")
            paths.append(modules["paths"][id(u)])
        elif isinstance(u, type):
            if u.__name__ not in classes:
                raise ValueError(f"parallel: 'fsdp_units' names the class {u.__name__}, which no module of the "
                                 f"forecast's model is (its classes: {', '.join(sorted(classes)) or 'no model given'})")
            paths += classes[u.__name__]
        elif isinstance(u, str) and u:
            paths += classes.get(u, [u])
        else:
            raise ValueError(f"parallel: 'fsdp_units' expects modules, module classes, class names or module paths, "
                             f"got {u!r}")
    root = modules.get("root")
    inner = [p for p in dict.fromkeys(paths) if p != root]
    # The root is a unit whatever is given: named alone, it is the only one.
    return "|".join(inner or ([root] if root else list(dict.fromkeys(paths))))


def _buffer_bytes(model) -> int:
    """Bytes of the module's buffers (BatchNorm's running statistics, ...): what DDP broadcasts before every
    forward (broadcast_buffers=True)."""
    if model is None or not hasattr(model, "buffers"):
        return 0
    return sum(b.numel() * b.element_size() for b in model.buffers())


@dataclass
class MemoryForecast:
    """Memory of the run, as torch.cuda.max_memory_allocated()/max_memory_reserved() would report it."""
    target: str
    batch_size: int
    per_rank_batch: int
    seq_len: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    first_iteration_peak_bytes: int
    steady_peak_bytes: int
    capacity_bytes: int
    outside_allocator_bytes: int
    max_batch_size: int
    fragmentation: float
    breakdown: dict
    peak_phase: str
    peak_op: str
    peak_module: str
    peak_iteration: int
    scaled: bool
    nonlinear_allocations: int
    allocations: int
    # Each {"code", "text"}: the code is stable (docs/design.md lists them), the text is for a person.
    warnings: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    forecast_ms: float = 0.0
    # GPU targets: convolution calls per iteration, the cuDNN workspace modelled at each (-1: not known, none
    # modelled), the largest workspace per call that leaves the forecast peaks as they are, and (probes on the GPU)
    # how many calls' workspaces were measured at the target batch.
    conv_calls: int = 0
    conv_workspace_bytes: int = -1
    conv_workspace_headroom_allocated_bytes: int = -1
    conv_workspace_headroom_reserved_bytes: int = -1
    conv_calls_measured: int = 0


@dataclass
class TimeForecast:
    """Step time of one training iteration at the target batch and parallel strategy (per rank)."""
    batch_size: int
    per_rank_batch: int
    dp: int
    tp: int
    pp: int
    micro_batches: int
    dp_mode: str
    step_ms: float
    compute_ms: float
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    other_ms: float
    comm_ms: float
    exposed_comm_ms: float
    tp_comm_ms: float
    pp_comm_ms: float
    bubble_ms: float
    timed_layers: int
    per_layer: list
    buckets: list
    comm: list
    clock: str
    notes: list = field(default_factory=list)  # each {"code", "text"}, as MemoryForecast.notes
    # The step's compute laid out: [{"name", "kind", "micro_batch", "stage", "start_ms", "end_ms"}] (what
    # save_timeline draws beside `comm`).
    compute: list = field(default_factory=list)
    # The graph network's correction (ScaleDL's alpha for compute, beta for exposed communication) and where it
    # came from: "gnn", or why it was not applied; step_ms, compute_ms and exposed_comm_ms include it (the
    # per-layer and per-phase times do not), uncorrected_step_ms does not.
    alpha: float = 1.0
    beta: float = 1.0
    correction: str = "none"
    uncorrected_step_ms: float = 0.0
    # With device clocks (probes on a GPU) or a GPU priced from CPU probes: the host's time to issue one
    # micro-batch's ops; the longer of it and the kernels is that micro-batch's compute (-1: not known).
    host_ms: float = -1.0


@dataclass
class Forecast:
    memory: MemoryForecast
    probe_batch_sizes: tuple
    probe_device: str
    context: dict
    time: TimeForecast | None = None
    timings: list = field(default_factory=list, repr=False)  # the probes' iteration timings (JSON texts)
    # With several timing rounds: each round's timings, in the order of `timings` (each probe's median over them)
    timing_rounds: list = field(default_factory=list, repr=False)
    target: str = "cpu"
    optimizer_name: str = "other"
    seq_len: int | None = None  # the forecast's sequence length (probes at several lengths), or None
    buffer_bytes: int = 0  # the model's buffers (what DDP broadcasts every step)
    # The model's modules by path and class (_module_paths): what parallel's fsdp_units names resolve to
    modules: dict = field(default_factory=dict, repr=False, compare=False)

    def step_time(self, batch_size: int, parallel: dict | None = None, link: dict | str | None = None,
                  time_scale: float = 1.0, time_fraction: float | None = None, design: str = "d-optimal",
                  gnn: str | None = "", seq_len: int | None = None,
                  time_budget: float | None = None) -> TimeForecast:
        """The step time at another batch size, sequence length (where the forecast was made with seq_len) or
        parallel strategy from the same probes: compare strategies without tracing again. Raises ValueError
        where the probes did not run on the forecast's target. time_fraction and time_budget None: the layers
        the forecast timed (all, or its sparse choice); either set: the layers chosen again among all by
        `design` (probes timed on the CPU only: device timers ran around the forecast's choice alone)."""
        if seq_len is not None and self.seq_len is None:
            raise ValueError("step_time: seq_len needs probes at several lengths (forecast(..., seq_len=))")
        if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
            raise ValueError(f"step_time: seq_len must be an integer of at least 1, got {seq_len!r}")
        length = seq_len if seq_len is not None else self.seq_len
        if not self.timings or self.time is None:
            raise ValueError("step_time: this forecast has no step time (see forecast(): target and probes)")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"step_time: batch_size must be an integer of at least 1, got {batch_size!r}")
        fraction = 1.0 if time_fraction is None else float(time_fraction)
        budget = 1.0 if time_budget is None else float(time_budget)
        every = time_fraction is not None or time_budget is not None
        prior_flops, prior_bytes = _prior(self.target, min(fraction, budget), self.timings, every)
        text = torch.ops.gpucast.forecast_step_time(
            self.timings, batch_size, parallel=_format_parallel(parallel, self.buffer_bytes, self.modules),
            link=_format_link(_default_link(link, self.target)), time_scale=float(time_scale), time_fraction=fraction,
            design=str(design), prior_flops_per_s=prior_flops, prior_bytes_per_s=prior_bytes,
            **_gpu_pricing(self.target, self.probe_device), seq_len=int(length or 0), every_layer=every,
            time_budget=budget, **_correction(self.target, self.optimizer_name, gnn, length))
        tf = TimeForecast(**json.loads(text))
        _note_default_link(tf, link, self.target)
        return tf

    def to_dict(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "context": self.context,
                "probe_batch_sizes": list(self.probe_batch_sizes), "probe_device": self.probe_device,
                "memory": dict(self.memory.__dict__),
                # The timeline's compute spans (layers x micro-batches of them) stay out: save_timeline draws them.
                "time": None if self.time is None else {k: v for k, v in self.time.__dict__.items() if k != "compute"}}

    def save_timeline(self, path: str) -> None:
        """The forecast step as a Chrome/Perfetto trace: per pipeline stage a compute stream (each layer's forward
        and backward pass per micro-batch in the schedule's order, "other", the optimizer step) and a
        communication stream (buffers' broadcast, all-reduce buckets, FSDP gathers and reduce-scatters,
        tensor-parallel all-reduces, pipeline sends). Where the graph network corrected the step, the drawn
        schedule is the uncorrected one and a mark shows where the corrected step ends."""
        if self.time is None:
            raise ValueError("save_timeline: this forecast has no step time (see forecast(): target and probes)")
        tm = self.time
        events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "gpucast forecast step"}}]
        for s in range(tm.pp):
            prefix = f"stage {s} " if tm.pp > 1 else ""
            events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": 2 * s, "args": {"name": prefix + "compute"}},
                       {"name": "thread_name", "ph": "M", "pid": 0, "tid": 2 * s + 1,
                        "args": {"name": prefix + "communication"}}]

        def add(name, start_ms, dur_ms, tid, cat, **args):
            events.append({"name": name, "cat": cat, "ph": "X", "pid": 0, "tid": tid, "ts": start_ms * 1e3,
                           "dur": max(dur_ms, 0.0) * 1e3, "args": args})
        for c in tm.compute:
            add(c["name"], c["start_ms"], c["end_ms"] - c["start_ms"], 2 * c["stage"], c["kind"],
                micro_batch=c["micro_batch"])
        for c in tm.comm:
            add(f"{c['kind']} ({c['bytes'] / 2**20:.2f} MiB)", c["start_ms"], c["end_ms"] - c["start_ms"],
                2 * c.get("stage", 0) + 1, "communication", bytes=c["bytes"])
        if tm.alpha != 1.0 or tm.beta != 1.0:
            events.append({"name": f"forecast step end (graph network: alpha {tm.alpha:.3f}, beta {tm.beta:.3f}; "
                                   f"uncorrected {tm.uncorrected_step_ms:.3f} ms)", "ph": "i", "s": "p", "pid": 0,
                           "tid": 0, "ts": tm.step_ms * 1e3})
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)

    def __str__(self) -> str:
        m = self.memory
        mib = 1024 * 1024
        lines = [f"gpucast forecast for {m.target}, batch {m.batch_size}"
                 f"{f' ({m.per_rank_batch} per rank)' if m.per_rank_batch != m.batch_size else ''}:",
                 f"  peak allocated {m.peak_allocated_bytes / mib:,.1f} MiB, reserved {m.peak_reserved_bytes / mib:,.1f} MiB"
                 f" (iteration {m.peak_iteration}, {m.peak_phase}{', ' + m.peak_op if m.peak_op else ''})"]
        if m.capacity_bytes:
            lines.append(f"  capacity {m.capacity_bytes / mib:,.0f} MiB, outside the allocator {m.outside_allocator_bytes / mib:,.0f} MiB,"
                         f" largest batch that fits: {m.max_batch_size}")
        if m.breakdown:
            lines.append("  at the peak: " + ", ".join(f"{k} {v / mib:,.1f} MiB" for k, v in
                                                       sorted(m.breakdown.items(), key=lambda kv: -kv[1])))
        if self.time is not None:
            tm = self.time
            lines.append(f"  step time {tm.step_ms:,.1f} ms: compute {tm.compute_ms:,.1f} ms (forward {tm.forward_ms:,.1f},"
                         f" backward {tm.backward_ms:,.1f}, optimizer {tm.optimizer_ms:,.1f}, other {tm.other_ms:,.1f})"
                         + (f", exposed communication {tm.exposed_comm_ms:,.1f} ms of {tm.comm_ms:,.1f}"
                            if tm.dp > 1 else ""))
            lines += [f"  note: {_first_line(n['text'])}" for n in tm.notes]
        lines += [f"  warning: {w['text']}" for w in m.warnings]
        lines += [f"  note: {_first_line(n['text'])}" for n in m.notes]
        return "\n".join(lines)


def note(code: str, text: str) -> dict:
    """A forecast's note or warning: a stable code (what callers and tests act on) and its text (gpucast/note.h)."""
    return {"code": code, "text": text}


def _first_line(text: str) -> str:
    """A note's first line: the rest (the layer models' fitted rates per kind) stays in the forecast's notes."""
    first, _, rest = text.partition("\n")
    return first + (" [more lines in the notes]" if rest.strip() else "")


def _storage_ptrs(objs: Iterable[Any]) -> list[int]:
    out = []
    for t in _flatten(list(objs), []):
        try:
            p = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            continue
        if p:
            out.append(p)
    return out


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to("cpu", copy=True) if obj.device.type != "cpu" else obj
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


class _State:
    """The model's and optimizer's state (and the RNG's), saved before the probes and restored after."""

    def __init__(self, model, optimizers: list):
        self.model, self.optimizers = model, optimizers
        self.rng = torch.get_rng_state()
        self.model_state = None
        self.grads = None
        # Copies live on the CPU, so that a GPU's baseline holds the job's memory only.
        if model is not None:
            self.model_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            self.grads = [None if p.grad is None else p.grad.detach().to("cpu", copy=True) for p in model.parameters()]
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


def run_forecaster(forecaster: Any, batch: int, target: str, capacity: int, safety: float, probe_device: str,
                   parallel: str, exclude: list, conv_workspace: int = -1) -> MemoryForecast:
    """MemoryForecaster.run with the settings PyTorch takes from the environment, read as PyTorch reads them:
    PYTORCH_ALLOC_CONF (else PYTORCH_CUDA_ALLOC_CONF), CUBLAS_WORKSPACE_CONFIG and CUDNN_CONV_WSCAP_DBG."""
    alloc_conf = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    text = forecaster.run(target_batch=batch, target=target, capacity_bytes=capacity, safety_fraction=safety,
                          probe_device=probe_device, parallel=parallel, alloc_conf=alloc_conf,
                          cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""), exclude=exclude,
                          conv_workspace=conv_workspace, cudnn_conv_wscap=os.environ.get("CUDNN_CONV_WSCAP_DBG", ""))
    return MemoryForecast(**json.loads(text))


def forecast(step: Callable[[Any], Any], make_batch: Callable[[int], Any], batch_size: int, *,
             model: torch.nn.Module | None = None,
             optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
             target: str = "cpu", parallel: dict | None = None, probe_batch_sizes: Iterable[int] = (2, 4, 8),
             capacity: int | None = None, safety_fraction: float = 0.9, iterations: int = 2,
             seq_len: int | None = None, probe_seq_lens: Iterable[int] | None = None,
             link: dict | str | None = None, time_fraction: float = 1.0, time_budget: float = 1.0,
             gnn: str | None = "", conv_workspace: int | None = None,
             timing_rounds: int | None = None) -> Forecast:
    """Forecast the run's memory at `batch_size` on `target` from probes at small batch sizes.

    step(batch) runs one full training iteration; make_batch(n) returns a batch of n samples. Each probe
    traces `iterations` iterations (2: the first, which creates optimizer state, and a steady one). With
    `model` and `optimizer`, their state (and the RNG's) is restored after the probes; without them, a
    warning says that the probes changed it. A step that runs several optimizers (one for some parameters,
    another for the rest) takes them all as a list: optimizer=[opt_a, opt_b]; steps with no backward pass
    between them are one iteration's optimizer. `target` is "cpu" (this host's CPU allocator bytes) or a
    GPU from gpucast.devices(); `capacity` overrides its memory in bytes. `parallel` is
    dict(dp=, tp=, pp=, dp_mode="ddp"|"zero1"|"zero2"|"fsdp", micro_batches=), and for the step time
    gradient_as_bucket_view=, broadcast_buffers=, buffer_bytes=, bucket_cap_mb= (DDP) and fsdp_units= (FSDP's
    units: modules of `model`, module classes or class names, or module paths such as "GPT.blocks.0"; without
    it every layer with parameters is a unit); `batch_size` is global.
    PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF and CUBLAS_WORKSPACE_CONFIG are read as PyTorch reads them.
    For a GPU target from CPU probes, convolutions run on cuDNN, whose workspace per call is chosen on the GPU:
    `conv_workspace` (bytes) models one at every convolution; without it CUDNN_CONV_WSCAP_DBG's cap (MiB) is
    modelled when set, else none, and fc.memory.conv_workspace_headroom_allocated_bytes / _reserved_bytes say
    how large each may be before the forecast peaks change. With probes on the target's GPU and `model`, cuDNN
    chooses again at the target batch: each torch.nn.ConvNd the probes called is run alone there (zero inputs of
    the probes' shape at the per-rank batch, forward and, where the probes ran it, backward) under a memory
    trace, and its workspace replaces the probes' (fc.memory.conv_calls_measured; `conv_workspace` skips this).

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
    for name, value in (("time_fraction", time_fraction), ("time_budget", time_budget)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ValueError(f"forecast: {name} must be a number in (0, 1], got {value!r}")
    if iterations not in (1, 2):
        raise ValueError(f"forecast: iterations must be 1 or 2, got {iterations!r}")
    if timing_rounds is not None and (isinstance(timing_rounds, bool) or not isinstance(timing_rounds, int)
                                      or timing_rounds < 1):
        raise ValueError(f"forecast: timing_rounds must be an integer of at least 1 (or None), got {timing_rounds!r}")
    target = str(target)
    if target != "cpu":
        known = {d["name"].lower() for d in devices()}
        if target.lower() not in known:
            names = ", ".join(d["name"] for d in devices())
            raise ValueError(f"forecast: unknown target '{target}'; known targets: cpu, {names}")
    modules = _module_paths(model)
    parallel_text = _format_parallel(parallel, modules=modules)
    # Checked before the probes run (errors name the key): each rank's batch for what is measured at the target.
    dp, tp, _, micro_batches = torch.ops.gpucast.check_parallel(parallel_text)
    if batch_size < dp * micro_batches:
        raise ValueError(f"forecast: batch_size {batch_size} is smaller than dp x micro_batches = "
                         f"{dp * micro_batches}: every rank needs a sample in every micro-batch")
    per_rank = max(1, batch_size // (dp * micro_batches))
    if conv_workspace is not None and (isinstance(conv_workspace, bool) or not isinstance(conv_workspace, int)
                                       or conv_workspace < 0):
        raise ValueError(f"forecast: conv_workspace must be a number of bytes of at least 0, got {conv_workspace!r}")

    optimizers = _optimizer_list(optimizer)
    state = _State(model, optimizers)
    if model is None or not optimizers:
        warnings.warn("gpucast.forecast: the probes ran training steps and changed the model's and optimizer's "
                      "state; pass model= and optimizer= to have them restored", stacklevel=2)
    forecaster = torch.classes.gpucast.MemoryForecaster()
    probe_device = "cpu"
    timings = []
    kernel_probes = []  # timing-only probes at the batch sizes where the target's kernels start
    reach_probes = []  # a timing-only probe nearer a target far beyond the probes
    reach_skipped = []  # such probes the device refused (out of memory)
    timed_layers = None  # sparse timing: the layers the timing traces time (None: every layer)
    largest_probe = None  # the largest probe's trace (batch scaling only)
    previous_probe = None  # the one before it, and both batches
    probe_batches: list = []
    retime: list = []  # each timing's (batch, length, structure): what a later round times again
    rounds: list = []  # each timing round's timings (timing_rounds > 1)
    conv_skipped: list = []
    op_skipped: list = []
    try:
        # The probes are timed with the C allocator as a process that has trained a while has it (no page faults
        # on every step for blocks a young process maps and unmaps): what the training after the forecast runs in.
        # The zoo GPT at 32 after the example's steps at 8: forecast +10.0 and +11.1 % without, -0.2 and -1.5 % with.
        torch.ops.gpucast.settle_c_allocator()
        # An untraced warm-up at the smallest probe size: lazy initialisations and caches of first calls
        # (optimizer defaults, kernels' scratch) would otherwise make the first probe differ from the others.
        warm = make_batch(*[x for x in design[0] if x is not None])
        for _ in range(iterations):
            try:
                step(warm)
            except RuntimeError as e:
                if torch.is_grad_enabled():
                    raise
                raise RuntimeError(f"forecast: the training step failed with gradients disabled (forecast was "
                                   f"called under torch.no_grad() or torch.inference_mode(); call it outside "
                                   f"them): {e}") from e
        del warm
        state.restore()
        show = sys.stderr.isatty()  # progress on a terminal, quiet otherwise
        for i, (b, length) in enumerate(design, 1):
            if show:
                what = f"batch {b}" + (f", length {length}" if length is not None else "")
                print(f"\rgpucast: probe {i}/{len(design)} ({what})   ", end="", file=sys.stderr, flush=True)
            gc.collect()  # garbage freed during a probe would change what it records
            batch = make_batch(b) if length is None else make_batch(b, length)
            probe_device = _device_of(batch)
            with trace(model=model) as t:
                for _ in range(iterations):
                    step(batch)
                    mark_iteration_end()
            if length is None:
                forecaster.add_probe(t.result.handle, b)
                previous_probe = largest_probe
                largest_probe = t.result.handle  # the design is in increasing batch size
                probe_batches.append(b)
            else:
                forecaster.add_probe_seq(t.result.handle, b, length)
            structure = t.result.handle.iteration_timing(b)
            t = None  # the memory trace is not needed any more
            timed = _time_on_target(target, probe_device)
            if timed and min(time_fraction, time_budget) < 1.0 and timed_layers is None:
                # Sparse timing: the layers to time, chosen once on the first probe's structure; every timing
                # trace then takes device timers around those layers only.
                timed_layers = list(torch.ops.gpucast.choose_timed_layers(
                    structure, float(time_fraction), time_budget=float(time_budget)))
            timing = _steady_timing(step, batch, b, structure, timed_layers, model=model) if timed else structure
            timings.append(timing if length is None else _with_seq(timing, length))
            if timed:
                retime.append((b, length, structure))
            del batch, t
            state.restore()
        def timing_probe(b: int) -> None:
            if show:
                print(f"\rgpucast: timing probe (batch {b})   ", end="", file=sys.stderr, flush=True)
            gc.collect()
            batch = make_batch(b)
            with trace(model=model) as t:  # what the memory trace does for the other probes: first steps, structure
                for _ in range(iterations):
                    step(batch)
                    mark_iteration_end()
            structure = t.result.handle.iteration_timing(b)
            del t
            timings.append(_steady_timing(step, batch, b, structure, timed_layers, model=model))
            retime.append((b, None, structure))
            del batch
            state.restore()

        for b in _kernel_probes(timings, per_rank, target, probe_device, design):
            timing_probe(b)
            kernel_probes.append(b)
        fits = None
        if target != "cpu" and probe_device.startswith("cuda"):
            def fits(b: int) -> bool:
                try:
                    m = run_forecaster(forecaster, b, target, 0, float(safety_fraction), probe_device, "",
                                       state.own_ptrs(), -1 if conv_workspace is None else conv_workspace)
                    dev = torch.device(probe_device)
                    free, _ = torch.cuda.mem_get_info(dev)
                    return _probe_fits(m.peak_reserved_bytes, free, torch.cuda.memory_reserved(dev))
                except Exception:  # no memory forecast at that batch: no probe there
                    return False
        for b in _reach_probes(timings, per_rank, target, probe_device, design, fits):
            try:
                timing_probe(b)
            except torch.cuda.OutOfMemoryError:
                # The memory forecast said it fits; the device said otherwise (another process took memory since):
                # the forecast goes on without it.
                reach_skipped.append(b)
                state.restore()
                continue
            finally:
                if probe_device.startswith("cuda"):
                    torch.cuda.empty_cache()  # the probe's larger blocks are not the job's
            reach_probes.append(b)
        n_rounds = (timing_rounds if timing_rounds is not None
                    else _CPU_TIMING_ROUNDS if probe_device == "cpu" else 1)
        if len(retime) == len(timings) and n_rounds > 1:
            rounds = [list(timings)]
            for _ in range(n_rounds - 1):
                rounds.append([_retimed(step, make_batch, b, length, structure, timed_layers, model, state, show)
                               for b, length, structure in retime])
            timings = _round_median(rounds)
        if (largest_probe is not None and model is not None and target != "cpu" and probe_device.startswith("cuda")
                and conv_workspace is None):
            # cuDNN chooses again at the target batch: each convolution's workspace measured there.
            from . import _conv_workspace
            doc = json.loads(largest_probe.to_json())
            if _conv_workspace.conv_calls(doc):
                ws, conv_skipped = _conv_workspace.measure_quietly(model, doc, per_rank, probe_device)
                if ws:
                    forecaster.set_conv_workspaces(ws)
            del doc
        if (target == "cpu" and probe_device == "cpu" and previous_probe is not None
                and probe_batches[-1] != probe_batches[-2] and tp == 1):
            # The CPU kernels size a matrix multiply's scratch by their blocking of the problem: each call's
            # measured at the target batch (under tensor parallelism the calls are split: not measured).
            from . import _op_workspace
            ws, op_skipped = _op_workspace.measure_quietly(largest_probe, previous_probe, probe_batches[-1],
                                                           probe_batches[-2], per_rank)
            if ws:
                forecaster.set_op_workspaces(ws, per_rank)
    finally:
        state.restore()
        if sys.stderr.isatty():
            print("\r" + " " * 60 + "\r", end="", file=sys.stderr, flush=True)
    cap = int(capacity) if capacity is not None else 0
    if seq_len is not None:
        forecaster.set_target_seq(seq_len)
    memory = run_forecaster(forecaster, batch_size, target, cap, float(safety_fraction), probe_device, parallel_text,
                            state.own_ptrs(), -1 if conv_workspace is None else conv_workspace)
    if op_skipped:
        shown = ", ".join(op_skipped[:3]) + (f" and {len(op_skipped) - 3} more" if len(op_skipped) > 3 else "")
        memory.notes.append(note("op-workspace-unmeasured", f"matrix multiplies: scratch not measured at the target "
                                                            f"batch for {shown}: the probes', scaled, is kept for "
                                                            f"those calls"))
    if conv_skipped:
        memory.notes.append(note("conv-workspace-unmeasured", f"cuDNN: workspaces not measured at the target batch "
                                                              f"for {', '.join(conv_skipped)}: the probes' are kept "
                                                              f"for those calls"))
    for o in optimizers:
        if isinstance(o, torch.optim.LBFGS):
            size = o.param_groups[0].get("history_size", 100)
            memory.warnings.append(note(
                "lbfgs-history", f"LBFGS keeps the directions of up to {size} past updates (history_size), one more "
                                 f"pair each inner iteration: its state grows over the run's first steps beyond what "
                                 f"the probes' {iterations} iteration(s) held, and the forecast peak leaves that "
                                 f"growth out"))
    for w in memory.warnings:
        warnings.warn(f"gpucast.forecast: {w['text']}", stacklevel=2)
    ctx = torch.ops.gpucast.context()
    context = {"gpucast_version": ctx[0], "torch_version": ctx[1], "device": ctx[2], "build_type": ctx[3]}
    buffer_bytes = _buffer_bytes(model)
    time_fc = _forecast_time(timings, batch_size, target, probe_device, parallel or {}, link,
                             time_fraction=time_fraction, optimizer_name=_optimizer_name(optimizer), gnn=gnn,
                             seq_len=seq_len, buffer_bytes=buffer_bytes, modules=modules)
    if time_fc is not None and kernel_probes:
        time_fc.notes.insert(0, note("im2col-probes", f"the probes ran convolutions on PyTorch's CPU im2col path (1x1, "
                                                      f"stride-1 kernels on one thread below batch 16), the target "
                                                      f"batch runs them through mkldnn: timing probes at batch "
                                                      f"{', '.join(map(str, kernel_probes))} added, and those layers "
                                                      f"fitted on them"))
    if time_fc is not None and reach_skipped:
        time_fc.notes.insert(0, note("reach-probe-skipped", f"a timing probe at batch {reach_skipped[0]} ran out of "
                                                            f"device memory and was left out: the fits extrapolate "
                                                            f"from the largest probe"))
    if time_fc is not None and reach_probes:
        time_fc.notes.insert(0, note("reach-probe", f"the target batch is more than {_REACH:g} times the largest "
                                                    f"probe: a timing probe at batch {reach_probes[0]} added (its "
                                                    f"forecast step under {_REACH_BUDGET_S:g} s"
                                                    + (f", its forecast memory within {_REACH_MEMORY_SHARE:.0%} of "
                                                       f"what the device can hold"
                                                       if probe_device.startswith("cuda") else "")
                                                    + "), so that the fits extrapolate 2 times at most"))
    fc = Forecast(memory=memory, probe_batch_sizes=tuple(sorted(set(probes))), probe_device=probe_device,
                  context=context, time=time_fc, timings=timings if time_fc is not None else [],
                  timing_rounds=rounds if time_fc is not None else [], target=target,
                  optimizer_name=_optimizer_name(optimizer), seq_len=seq_len, buffer_bytes=buffer_bytes,
                  modules=modules)
    from . import trackers
    trackers.publish(fc)
    return fc


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
_REACH_MEMORY_SHARE = 0.8


def _probe_fits(peak_reserved_bytes: int, free_bytes: int, reserved_bytes: int) -> bool:
    """Whether a probe whose forecast reserved peak is peak_reserved_bytes (the process's whole reservation, its
    current one included) fits in _REACH_MEMORY_SHARE of the device memory free now plus what the allocator holds."""
    return peak_reserved_bytes <= _REACH_MEMORY_SHARE * (free_bytes + reserved_bytes)


# Timing rounds where the probes run on the CPU (forecast's timing_rounds None). On a shared 2-core host a probe's
# untraced step moved by up to 42 % between rounds a few seconds apart, and a forecast at 2 to 32 times the largest
# probe multiplies a slope's error: over 40 forecasts of the accuracy bench's ten cases (bench/timing_rounds.py,
# 2026-12-06, without the graph network) the step's mean |error| was 6.86 % (RMS 10.38) from the first round alone,
# 4.88 % from the median of two rounds and 4.45 % (RMS 6.40) from that of three. A GPU's clocks are steadier: 1 there.
_CPU_TIMING_ROUNDS = 3


def _retimed(step: Callable[[Any], Any], make_batch: Callable[..., Any], b: int, length: int | None, structure: str,
             timed_layers: list | None, model: torch.nn.Module | None, state: "_State", show: bool) -> str:
    """A probe's steady timing again, in a later round (no memory trace: its structure is the first round's). Two
    untraced warm-ups: the state restored after the last probe has no optimizer state yet."""
    if show:
        print(f"\rgpucast: timing again (batch {b})   ", end="", file=sys.stderr, flush=True)
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
    d = json.loads(torch.ops.gpucast.median_timing(light))
    d["untraced_wall_ns"] = float(statistics.median(times))
    return torch.ops.gpucast.timing_with_structure(json.dumps(d), structure)


_RATES: dict = {}


def cpu_rates() -> dict:
    """This CPU's float32 matmul rate and copy bandwidth on the current thread count, measured once per process
    (a few milliseconds): global features of the graph network."""
    if not _RATES:
        a = torch.full((512, 512), 0.5)  # not random: the caller's RNG stays as it was
        b = torch.full((512, 512), 0.25)
        for _ in range(3):
            a @ b
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        gflops = 10 * 2 * 512 ** 3 / (time.perf_counter() - t0) / 1e9
        x = torch.empty(16 << 20, dtype=torch.uint8)
        y = torch.empty_like(x)
        y.copy_(x)
        t0 = time.perf_counter()
        for _ in range(10):
            y.copy_(x)
        gbps = 10 * 2 * x.numel() / (time.perf_counter() - t0) / 1e9
        _RATES.update(peak_gflops=round(gflops, 2), mem_gbps=round(gbps, 2))
    return dict(_RATES)


def _prior(target: str, time_fraction: float, timings: list, every_layer: bool = False) -> tuple:
    """The layer models' prior rates (FLOP/s, bytes/s) for sparse timing (a fraction below 1, or probes traced with
    a choice of layers, unless every_layer): this CPU's, measured; 0 elsewhere (the core's defaults)."""
    chosen = (not every_layer and bool(timings)
              and any(not x.get("timed", True) for x in json.loads(timings[-1])["layers"]))
    if target != "cpu" or (time_fraction >= 1.0 and not chosen):
        return 0.0, 0.0
    r = cpu_rates()
    return r["peak_gflops"] * 1e9, r["mem_gbps"] * 1e9


def _optimizer_list(optimizer) -> list:
    """forecast's optimizer= as a list: none, one, or a list or tuple of them (each with state_dict and
    load_state_dict); TypeError naming what was given otherwise."""
    if optimizer is None:
        return []
    many = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for i, o in enumerate(many):
        if not (callable(getattr(o, "state_dict", None)) and callable(getattr(o, "load_state_dict", None))):
            where = f"optimizer[{i}]" if isinstance(optimizer, (list, tuple)) else "optimizer"
            raise TypeError(f"forecast: {where} must be a torch.optim.Optimizer (or a list of them), got "
                            f"{type(o).__name__}")
    return many


def _optimizer_name(optimizer) -> str:
    """The optimizer as the graph network knows it (sgd, adam, adamw, other); a list: the first one's."""
    if isinstance(optimizer, (list, tuple)):
        optimizer = optimizer[0] if optimizer else None
    name = type(optimizer).__name__.lower() if optimizer is not None else ""
    return name if name in ("sgd", "adam", "adamw") else "other"


def _correction(target: str, optimizer_name: str, weights: str | None, seq_len: int | None = None) -> dict:
    """forecast_step_time's arguments for the graph network's correction (ScaleDL's alpha and beta; the rules of
    where it applies are C++'s, gpucast/step_gnn.h: correct_step_time). weights: a file, "" for the shipped one,
    None for none. The network's global features: the optimizer, the thread count and this CPU's measured rates
    (measured only where a correction may be made)."""
    args = dict(correct=True, gnn=weights, target=target, optimizer=optimizer_name, threads=torch.get_num_threads())
    if weights is not None and target == "cpu" and not seq_len:
        args.update(cpu_rates())
    return args


def _time_on_target(target: str, probe_device: str) -> bool:
    return (target == "cpu" and probe_device == "cpu") or (target != "cpu" and probe_device.startswith("cuda"))


def _gpu_pricing(target: str, probe_device: str) -> dict:
    """forecast_step_time's arguments for a GPU target whose probes ran on the CPU: every layer priced from the
    GPU rates table (gpu_rates.h), with this process's TF32 settings."""
    if target == "cpu" or probe_device != "cpu":
        return {}
    return {"gpu": target, "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
            "tf32_conv": bool(torch.backends.cudnn.allow_tf32)}


def _with_seq(timing: str, length: int) -> str:
    """An iteration timing (JSON) marked with the probe's sequence length."""
    d = json.loads(timing)
    d["seq"] = int(length)
    return json.dumps(d)


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
            warnings.warn(f"gpucast.forecast: the step-time forecast failed ({type(e).__name__}: {e}); no step "
                          f"time, the memory forecast stands", stacklevel=3)
            return None
        if not pricing or error_code(e) != "gpu-rates":
            raise
        # A table of the user's (GPUCAST_GPU_RATES) that cannot be used: the shipped one, said aloud.
        shipped = Path(torch.ops.gpucast.gpu_rates_path(True))
        text = None
        if os.environ.get("GPUCAST_GPU_RATES") and shipped.is_file():
            try:
                text = run({**pricing, "gpu_rates": str(shipped)})
                warnings.warn(f"gpucast.forecast: GPUCAST_GPU_RATES could not be used for {target} ({e}); the step "
                              f"time is priced from the shipped table {shipped}", stacklevel=3)
            except (ValueError, RuntimeError):
                text = None
        if text is None:
            warnings.warn(f"gpucast.forecast: no step time for {target}: {e}", stacklevel=3)
            return None
    tf = TimeForecast(**json.loads(text))
    _note_default_link(tf, link, target, stacklevel=4)
    if not tf.per_layer:
        msg = ("no layer ran outside the optimizer's step: an optimizer that takes a closure (LBFGS) runs the "
               "forward and backward inside its step, whose time is then the optimizer's, the time of the probe "
               "nearest the batch in size, not scaled to the batch")
        tf.notes.insert(0, note("layers-in-optimizer", msg))
        warnings.warn(f"gpucast.forecast: {msg}", stacklevel=3)
    if probe_device != "cpu" and any(json.loads(t).get("clock") == "cpu" for t in timings):
        # No device timer recorded the probes' kernels (the trace's notes say why): their host clocks measure
        # the launches, which on a GPU neither scale with the batch nor add up to the kernels' time.
        msg = (f"the probes on {probe_device} carry host clock times only (no device timer recorded their "
               f"kernels; see the trace's notes): the step time measures launches, not the kernels, and does not "
               f"scale with the batch as the GPU's work does")
        tf.notes.insert(0, note("host-clocks-only", msg))
        warnings.warn(f"gpucast.forecast: {msg}", stacklevel=3)
    return tf
