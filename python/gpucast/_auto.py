"""Auto mode from Python: GPUCAST_CONF="enabled:True,..." in the environment of a training script that imports gpucast.

The plugin runs auto mode itself (plugin/auto_mode.h; the same with torch.ops.load_library alone): it traces the
first iteration, forecasts the run from it, and appends the forecast to GPUCAST_LOG. What this module adds: the
verdict reaches the user as gpucast.OutOfMemoryRiskWarning attributed to the user's own line, or with on_risk:raise
as gpucast.OutOfMemoryRisk raised from the optimizer's step post-hook (where the iteration waits for the next
forward, from that module's forward pre-hook, before it runs); and the forecast reaches the trackers (gpucast.log_to,
MLflow and W&B runs). The hooks ask the plugin at those points (torch.ops.gpucast.auto_poll); they never run inside
an op's callback.
"""
from __future__ import annotations

import json
import sys
import threading

import torch
import torch.optim.optimizer as _optimizer_module

from ._results import MemoryForecast
from ._settings import env_text
from ._trace import compiling
from ._warnings import warn

_ops = torch.ops.gpucast


class OutOfMemoryRisk(RuntimeError):
    """Raised (with on_risk:raise) when the forecast run does not fit the device."""


class OutOfMemoryRiskWarning(UserWarning):
    """Warned (with on_risk:warn, the default) when the forecast run does not fit the device."""


_config: dict | None = None
_session: "_AutoSession | None" = None
_lock = threading.Lock()


def config() -> dict:
    """GPUCAST_CONF, read and checked by the plugin (ValueError naming the key, what it expects and the value)."""
    global _config
    if _config is None:
        _config = json.loads(_ops.parse_auto_config(env_text("GPUCAST_CONF")))
    return _config


def _reset() -> None:
    """Stop auto mode and forget the configuration (python -m gpucast run reads it again; tests)."""
    global _config, _session
    if _session is not None:
        _session.close()
    _ops.auto_stop()
    _config, _session = None, None


def _resolve_target(name: str) -> str:
    """"auto": this process's GPU as a device table name, else "cpu" (the plugin's rule); other names as given."""
    return _ops.auto_target(name)


def judge(f: MemoryForecast, capacity_mb: int, warn_fraction: float, on_risk: str) -> bool:
    """Warn (or raise OutOfMemoryRisk) when the forecast needs more than warn_fraction of the capacity (the plugin's
    rule, torch.ops.gpucast.judge_memory)."""
    v = json.loads(_ops.judge_memory(json.dumps(f.__dict__), int(capacity_mb), float(warn_fraction)))
    if not v["risk"]:
        return False
    if on_risk == "raise":
        raise OutOfMemoryRisk(v["message"])
    warn(v["message"], OutOfMemoryRiskWarning)
    return True


def forecast_traced_step(t, batch: int, target: str, capacity_mb: int = 0, safety: float = 0.9) -> MemoryForecast:
    """The run's forecast from one traced iteration at its real batch size, as auto mode makes it."""
    conf = f"target:{target},capacity_mb:{int(capacity_mb)},warn_fraction:{float(safety)!r}"
    return MemoryForecast(**json.loads(_ops.auto_forecast(t.handle, int(batch), conf))["record"]["memory"])


class _AutoSession:
    """The Python hooks of one auto-mode run: they ask the plugin whether the iteration ended, and report."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.forecast: MemoryForecast | None = None
        self.batch = 1
        self.deferred = False  # the plugin waits for the next forward to end the iteration
        self.done = False
        m = torch.nn.modules.module
        self.handles = [m.register_module_forward_pre_hook(self._on_forward),
                        _optimizer_module.register_optimizer_step_post_hook(self._on_step_end)]

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _on_forward(self, module, args) -> None:
        if compiling():  # inside a function torch.compile traces: nothing to do there (see _trace.compiling)
            return
        if self.done:
            self.close()  # safe here: PyTorch iterates over a copy of the forward pre-hooks
            return
        if self.deferred:  # may raise OutOfMemoryRisk (on_risk:raise), before this forward runs
            self._poll(at_step=False)

    def _on_step_end(self, optimizer, args, kwargs) -> None:
        if compiling() or self.done:
            return
        self._poll(at_step=True)  # may raise OutOfMemoryRisk; hooks are removed at the next forward

    def _poll(self, at_step: bool) -> None:
        try:
            r = json.loads(_ops.auto_poll(at_step))
        except Exception as e:  # noqa: BLE001 - fail open
            self.done = True
            warn(f"gpucast: auto mode stopped after an internal error ({type(e).__name__}: {e}); "
                          "training goes on", RuntimeWarning)
            return
        self.deferred = r["state"] == "deferred"
        self.done = r["state"] in ("done", "off")
        if r["verdict"] is not None:
            self._report(r["verdict"])

    def _report(self, v: dict) -> None:
        try:
            memory = v["record"]["memory"]
            self.forecast = MemoryForecast(**memory)
            self.batch = memory["batch_size"]
            self._track(self.forecast, v["record"]["context"])
        except Exception as e:  # noqa: BLE001 - fail open: the verdict still stands
            warn(f"gpucast: auto mode could not publish the forecast ({type(e).__name__}: {e})",
                          RuntimeWarning)
        for w in v["warnings"]:
            if w["code"] == "trace-capped":
                warn(f"gpucast: the first iteration's trace reached its cap: the forecast is a lower bound "
                              f"({w['text']})", RuntimeWarning)
        if v["risk"]:
            if v["raise"]:
                raise OutOfMemoryRisk(v["message"])
            warn(v["message"], OutOfMemoryRiskWarning)
        elif self.cfg.get("verbose"):
            print(v["message"], file=sys.stderr, flush=True)

    def _track(self, f: MemoryForecast, context: dict) -> None:
        """Loggers from gpucast.log_to(), and trackers with an active run (MLflow, W&B), get the forecast."""
        from . import trackers
        from ._results import Forecast
        fc = Forecast(memory=f, probe_batch_sizes=(self.batch,), probe_device="", context=context)
        trackers.publish(fc)
        found = trackers.active_trackers()
        if found:
            trackers.Logger(found).log_forecast(fc)


def maybe_start() -> None:
    """Called by `import gpucast`: configure the plugin's auto mode from GPUCAST_CONF, and hook in where it enables
    it (ValueError for a bad configuration)."""
    global _session
    with _lock:
        if _session is not None or not config()["enabled"]:
            return
        _ops.auto_configure(env_text("GPUCAST_CONF"), True)
        _session = _AutoSession(config())


def session() -> "_AutoSession | None":
    return _session
