"""What gpucast.forecast() returns: the memory and step-time forecasts (values the C++ forecasts fill), and how a
forecast is asked again (Forecast.step_time), saved (to_dict, save_timeline) and shown."""
from __future__ import annotations

import json
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ._settings import (_correction, _default_link, _format_link, _format_parallel, _gpu_pricing, _note_default_link,
                        _prior)

# to_dict()'s layout. 2: what does not apply to the target is null, not 0 or -1 (see _memory_dict).
SCHEMA_VERSION = 2


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
    # A rule the forecast applied is not yet matched to its engine (tensor and pipeline parallelism, ZeRO-2, FSDP):
    # the peaks may be off either way, as approximate_reason says (also a warning, code approximate-rule).
    approximate: bool = False
    approximate_reason: str = ""
    # Per group of data-parallel ranks that hold alike, each {"ranks": [...], "peak_allocated_bytes",
    # "peak_reserved_bytes", "breakdown"}; peak_* above are the largest group's. One group without data parallelism.
    per_rank: list = field(default_factory=list)
    # Routed layers (mixture of experts) in the probes, else None: {"routed_calls", "experts", "top_k", "skew",
    # "routed_allocations", "unexplained_allocations", "expected_peak_allocated_bytes", "expected_peak_reserved_bytes",
    # "bound_peak_allocated_bytes", "bound_peak_reserved_bytes"}. peak_* above are the bound's (moe_skew).
    moe: dict | None = None


def _memory_dict(m: MemoryForecast) -> dict:
    """The memory forecast's fields, with null for what does not apply: a target without a capacity (cpu) has no
    capacity_bytes and no max_batch_size (0 would read as "nothing fits"); a cuDNN workspace gpucast neither
    modelled nor bounded (-1 in the dataclass) is null."""
    d = dict(m.__dict__)
    if m.capacity_bytes == 0:
        d["capacity_bytes"] = d["max_batch_size"] = None
    for k in ("conv_workspace_bytes", "conv_workspace_headroom_allocated_bytes",
              "conv_workspace_headroom_reserved_bytes"):
        if d[k] == -1:
            d[k] = None
    return d


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
    # Under gpucast.simulated_ranks: {"traced_world": n, "traced_rank": r}, kept in every parallel= of step_time()
    traced: dict = field(default_factory=dict, repr=False, compare=False)
    # The probes' traces and settings (_forecast._MemoryPricer): what memory_at prices again; None where the forecast
    # was not made by gpucast.forecast (auto mode, a forecast read back)
    _pricer: Any = field(default=None, repr=False, compare=False)

    def memory_at(self, batch_size: int, *, target: str | None = None, parallel: dict | None = None,
                  capacity: int | None = None, safety_fraction: float | None = None,
                  moe_skew: float | None = None) -> MemoryForecast:
        """The memory forecast at another global batch size, GPU target or parallel layout (dict as forecast()'s
        `parallel`; None: a single rank) from the same probes: size every GPU and layout of a job from one set of
        traces. Arguments left None take the forecast's own (target and its capacity, safety_fraction,
        moe_skew; a target given without a capacity: the table's). Under gpucast.simulated_ranks, the rank traced is
        kept in every layout, as step_time keeps it. The probes stay as they ran: the check probe and measured workspaces were chosen for the
        forecast's own target batch. ValueError as forecast() for a bad batch, target or layout."""
        if self._pricer is None:
            raise ValueError("memory_at: this forecast holds no probe traces (made by gpucast.forecast only)")
        return self._pricer(batch_size, target, parallel, capacity, safety_fraction, moe_skew)

    def __getstate__(self) -> dict:
        """Pickled and copied without the probes' traces (a C++ object): a copy answers memory_at with ValueError."""
        state = dict(self.__dict__)
        state.pop("_pricer", None)
        return state

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
            self.timings, batch_size,
            parallel=_format_parallel({**(parallel or {}), **self.traced} if self.traced else parallel,
                                      self.buffer_bytes, self.modules),
            link=_format_link(_default_link(link, self.target)), time_scale=float(time_scale), time_fraction=fraction,
            design=str(design), prior_flops_per_s=prior_flops, prior_bytes_per_s=prior_bytes,
            **_gpu_pricing(self.target, self.probe_device), seq_len=int(length or 0), every_layer=every,
            time_budget=budget, **_correction(self.target, self.optimizer_name, gnn, length))
        tf = TimeForecast(**json.loads(text))
        _note_default_link(tf, link, self.target)
        return tf

    def to_dict(self) -> dict:
        """Everything, JSON-ready; null where a field does not apply (see _memory_dict)."""
        return {"schema_version": SCHEMA_VERSION, "context": self.context,
                "probe_batch_sizes": list(self.probe_batch_sizes), "probe_device": self.probe_device,
                "memory": _memory_dict(self.memory),
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
        torch.ops.gpucast.save_step_timeline(json.dumps(dataclasses.asdict(self.time)), str(path))

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


def _first_line(text: str) -> str:
    """A note's first line: the rest (the layer models' fitted rates per kind) stays in the forecast's notes."""
    first, _, rest = text.partition("\n")
    return first + (" [more lines in the notes]" if rest.strip() else "")
