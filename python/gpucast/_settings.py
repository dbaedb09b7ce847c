"""What a forecast's settings mean to the C++ ops: the device, GPU-rates and interconnect tables, the link and
parallel strategy as configuration text, the model's module paths (FSDP's units), the optimizer, and the arguments
that price a GPU from CPU probes or correct a CPU step with the graph network. No forecasting here: C++ does it."""
from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING

import torch

from ._notes import note
from ._warnings import warn

if TYPE_CHECKING:
    from ._results import TimeForecast


def env_text(name: str, default: str = "") -> str:
    """The environment variable as text the ops accept: os.environ keeps bytes that are not UTF-8 as lone
    surrogates, which no op can take; such a value is a ValueError naming the variable."""
    value = os.environ.get(name, default)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name}: not UTF-8 at character {e.start}; gpucast reads configuration as UTF-8 text") from None
    return value


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
    return json.loads(torch.ops.gpucast.device_table())


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


def _note_default_link(tf: "TimeForecast", link: dict | str | None, target: str) -> None:
    used = _default_link(link, target)
    if link is None and used and tf.dp * tf.tp * tf.pp > 1:
        tf.notes.insert(0, note("default-link", f"link: {target}'s usual node assumed ({used}, the device table's "
                                                f"default); pass link= (gpucast.calibrate() on the job's process "
                                                f"group, or a topology) for another"))
    if not used and tf.dp * tf.tp * tf.pp > 1:
        warn(f"gpucast.forecast: no link is known for target '{target}', so the step's collectives "
                      f"(dp={tf.dp}, tp={tf.tp}, pp={tf.pp}) are left out of it; pass link=gpucast.calibrate() "
                      f"(run on the job's process group) or a topology such as 'intra:nvlink4,gpus_per_node:8'")


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
            known = set(modules.get("paths", {}).values())
            if u not in classes and known and u not in known:
                some = ", ".join(sorted(known, key=len)[:3])
                raise ValueError(f"parallel: 'fsdp_units' names '{u}', which is neither a module path of the "
                                 f"forecast's model nor one of its classes (paths such as {some})")
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
    """forecast_step_time's arguments for a GPU target whose probes ran on the CPU or the meta device: every layer
    priced from the GPU rates table (gpu_rates.h), with this process's TF32 settings."""
    if target == "cpu" or probe_device not in ("cpu", "meta"):
        return {}
    return {"gpu": target, "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
            "tf32_conv": bool(torch.backends.cudnn.allow_tf32)}
