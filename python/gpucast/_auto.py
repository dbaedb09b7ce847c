"""Auto mode: GPUCAST_CONF="enabled:True,..." in the environment of a training script that imports gpucast.

gpucast traces the first iteration by itself (from the first forward of a module to the end of the first
optimizer step), forecasts the run, and, before the second iteration commits its memory, warns once when the
forecast reserved bytes plus what the allocator does not count exceed warn_fraction of the capacity; with
on_risk:raise it raises OutOfMemoryRisk from the optimizer's step post-hook instead. Where that optimizer does
not hold every parameter that has a gradient (a step that runs several optimizers, one after the other), the
iteration ends at the step of the optimizer that completes them, or else at the next forward of a module
(whose pre-hook then warns or raises, before that forward runs). Each forecast is
appended as one JSON line to the file named by GPUCAST_LOG. Internal errors become one warning and training
goes on.
"""
from __future__ import annotations

import json
import os
import threading
import time
import warnings
from typing import Any

import torch
import torch.optim.optimizer as _optimizer_module

from ._forecast import run_forecaster
from ._jsonl import append_record
from ._results import SCHEMA_VERSION, MemoryForecast
from ._settings import env_text
from ._trace import _flatten, compiling, trace

_ops = torch.ops.gpucast


class OutOfMemoryRisk(RuntimeError):
    """Raised (with on_risk:raise) when the forecast run does not fit the device."""


class OutOfMemoryRiskWarning(UserWarning):
    """Warned (with on_risk:warn, the default) when the forecast run does not fit the device."""


_config: dict | None = None
_session: "_AutoSession | None" = None
_lock = threading.Lock()


def config() -> dict:
    """GPUCAST_CONF, parsed once (ValueError naming the key, the expected form and the value)."""
    global _config
    if _config is None:
        _config = json.loads(_ops.parse_auto_config(env_text("GPUCAST_CONF")))
    return _config


def _reset() -> None:
    """For tests: forget the parsed configuration and uninstall auto mode."""
    global _config, _session
    if _session is not None:
        _session.close()
    _config, _session = None, None


def _resolve_target(name: str) -> str:
    if name != "auto":
        return name
    if torch.cuda.is_available():
        props_name = torch.cuda.get_device_name(0).upper()
        for key, table_name in (("H200", "H200-141GB"), ("H100", "H100-80GB"), ("A100", None), ("L4", "L4"),
                                ("V100", "V100-32GB"), ("4090", "RTX-4090")):
            if key in props_name:
                if table_name is None:  # A100 comes in two sizes
                    total = torch.cuda.get_device_properties(0).total_memory
                    return "A100-80GB" if total > 60 * 2**30 else "A100-40GB"
                return table_name
    return "cpu"


def _batch_size_of(args: Any) -> int:
    tensors = _flatten(args, [])
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() > 0 else 1


class _AutoSession:
    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.target = _resolve_target(cfg["target"])
        self.trace: trace | None = None
        self.batch = 1
        self.done = False
        self.forecast: MemoryForecast | None = None
        self.root: torch.nn.Module | None = None  # the first module called: the model
        self.stepped: set[int] = set()  # ids of the parameters the optimizers stepped so far held
        self.deferred = False  # an optimizer stepped, another may follow: end at the next forward at the latest
        m = torch.nn.modules.module
        self.handles = [m.register_module_forward_pre_hook(self._on_forward),
                        _optimizer_module.register_optimizer_step_post_hook(self._on_step_end)]

    def close(self) -> None:
        if self.trace is not None and _ops.is_tracing():
            self.trace._finish(unhook=False)
        self._unhook()

    def _on_forward(self, module, args) -> None:
        if compiling():  # inside a function torch.compile traces: nothing to do there (see _trace.compiling)
            return
        if self.done:
            self._unhook()  # safe here: PyTorch iterates over a copy of the forward pre-hooks
            return
        if self.deferred:  # the first forward after the optimizers stepped: the iteration has ended
            try:
                self._end_iteration()  # may raise OutOfMemoryRisk (on_risk:raise), before this forward runs
            finally:
                self._unhook()
            return
        if self.trace is not None:
            return
        try:
            self.root = module
            self.batch = _batch_size_of(args)
            self.trace = trace()
            self.trace.__enter__()
            # The trace's own hooks were installed during this call's hooks: enter this module by hand.
            self.trace._hooks.pre(module, args)
        except Exception as e:  # noqa: BLE001 - fail open
            self._fail(e)

    def _on_step_end(self, optimizer, args, kwargs) -> None:
        if compiling():  # inside a function torch.compile traces: nothing to do there (see _trace.compiling)
            return
        if self.done or self.trace is None:
            return
        try:
            self.stepped.update(id(p) for g in optimizer.param_groups for p in g["params"])
            if self.root is not None and any(p.grad is not None and id(p) not in self.stepped
                                             for p in self.root.parameters()):
                self.deferred = True  # another optimizer holds the rest: its step ends the iteration
                return
        except Exception as e:  # noqa: BLE001 - fail open
            self._fail(e)
            return
        self._end_iteration()

    def _end_iteration(self) -> None:
        self.done = True
        self.deferred = False
        try:
            # Inside PyTorch's loop over optimizer hooks (or a module's forward pre-hooks): stop recording,
            # unhook at the next forward.
            self.trace._finish(unhook=False)
            self.forecast = self._forecast(self.trace.result)
            self._log(self.forecast)
            self._track(self.forecast)
        except Exception as e:  # noqa: BLE001 - fail open
            self._fail(e)
            return
        self._judge(self.forecast)

    def _unhook(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        if self.trace is not None:
            self.trace._hooks.remove()
            self.trace = None

    def _forecast(self, t) -> MemoryForecast:
        return forecast_traced_step(t, self.batch, self.target, self.cfg["capacity_mb"], self.cfg["warn_fraction"])

    def _log(self, f: MemoryForecast) -> None:
        path = os.environ.get("GPUCAST_LOG")
        if not path:
            return
        record = {"schema_version": SCHEMA_VERSION, "time": time.time(), "mode": "auto",
                  "context": json.loads(_ops.context()), "memory": dict(f.__dict__)}
        try:
            append_record(path, record)  # append: an existing log is never truncated
        except OSError as e:
            warnings.warn(f"gpucast: cannot append the forecast to GPUCAST_LOG={path!r}: {e.strerror or e}",
                          stacklevel=3)

    def _track(self, f: MemoryForecast) -> None:
        """Loggers from gpucast.log_to(), and trackers with an active run (MLflow, W&B), get the forecast."""
        from . import trackers
        from ._results import Forecast
        fc = Forecast(memory=f, probe_batch_sizes=(self.batch,), probe_device="", context=json.loads(_ops.context()))
        trackers.publish(fc)
        found = trackers.active_trackers()
        if found:
            trackers.Logger(found).log_forecast(fc)

    def _judge(self, f: MemoryForecast) -> None:
        capped = [w["text"] for w in f.warnings if w["code"] == "trace-capped"]
        if capped:
            warnings.warn(f"gpucast: the first iteration's trace reached its cap: the forecast "
                          f"({f.peak_reserved_bytes / 2**20:,.0f} MiB reserved) is a lower bound ({capped[0]})",
                          RuntimeWarning,
                          stacklevel=4)
        judge(f, self.cfg["capacity_mb"], self.cfg["warn_fraction"], self.cfg["on_risk"], stacklevel=4)

    def _fail(self, e: Exception) -> None:
        self.done = True
        if self.trace is not None and _ops.is_tracing():
            self.trace._finish(unhook=False)
        warnings.warn(f"gpucast: auto mode stopped after an internal error ({type(e).__name__}: {e}); "
                      "training goes on", RuntimeWarning, stacklevel=3)


def forecast_traced_step(t, batch: int, target: str, capacity_mb: int = 0, safety: float = 0.9) -> MemoryForecast:
    """The run's forecast from one traced iteration at the real batch size (model states kept, the rest as traced)."""
    forecaster = torch.classes.gpucast.MemoryForecaster()
    forecaster.add_probe(t.handle, batch)
    # Asked of the C++ trace: no JSON is built on the way from iteration 1 to iteration 2.
    device = "cuda:0" if t.peak_bytes("cuda:0") > 0 else "cpu"
    return run_forecaster(forecaster, batch, _resolve_target(target), capacity_mb * 2**20, safety, device, "", [])


def judge(f: MemoryForecast, capacity_mb: int, warn_fraction: float, on_risk: str, stacklevel: int = 2) -> bool:
    """Warn (or raise OutOfMemoryRisk) when the forecast needs more than warn_fraction of the capacity."""
    capacity = capacity_mb * 2**20 if capacity_mb else f.capacity_bytes
    if not capacity:
        return False
    need = f.peak_reserved_bytes + f.outside_allocator_bytes
    if need <= warn_fraction * capacity:
        return False
    mib = 2**20
    fits = f"the largest batch that fits is {f.max_batch_size}" if f.max_batch_size else "no batch size fits"
    msg = (f"gpucast: out-of-memory risk on {f.target}: the run needs {need / mib:,.0f} MiB "
           f"(reserved {f.peak_reserved_bytes / mib:,.0f} MiB + {f.outside_allocator_bytes / mib:,.0f} MiB outside the "
           f"allocator) at batch {f.batch_size}, above {warn_fraction:.0%} of {capacity / mib:,.0f} MiB; {fits}")
    if on_risk == "raise":
        raise OutOfMemoryRisk(msg)
    warnings.warn(msg, OutOfMemoryRiskWarning, stacklevel=stacklevel)
    return True


def maybe_start() -> None:
    """Called by `import gpucast`: start auto mode if GPUCAST_CONF enables it."""
    global _session
    with _lock:
        if _session is not None or not config()["enabled"]:
            return
        _session = _AutoSession(config())


def session() -> "_AutoSession | None":
    return _session
