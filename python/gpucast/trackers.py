"""Experiment trackers: the forecast next to the loss curve, and the measured values beside it.

    gpucast.log_to(writer)           # torch.utils.tensorboard.SummaryWriter
    gpucast.log_to(mlflow)           # the mlflow module (its active run) or an mlflow.ActiveRun
    gpucast.log_to(wandb.run)        # a Weights & Biases run (online or offline)
    gpucast.log_to("forecasts.jsonl")  # JSON Lines, appended

Each forecast is logged as parameters (target, batch size), metrics (peak allocated and reserved MiB,
capacity, largest batch that fits) and the whole forecast as a document; then, for the first `steps`
optimizer steps, the measured peak beside the forecast (torch.cuda.max_memory_allocated()/reserved() on a
GPU, the CPU allocator's peak otherwise), so the forecast's quality is visible over the first steps.
A tracker that is not installed or has no active run gives one clear message and gpucast goes on.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import torch.optim.optimizer as _optimizer_module

from ._errors import optional_import
from ._jsonl import append_record
from ._warnings import warn

MIB = 2**20


def _scalars(memory, time_fc: dict | None = None) -> dict[str, float]:
    """Forecast scalars: peak memory, capacity and largest batch; step time where the forecast has one."""
    m = memory
    out = {"gpucast/forecast_peak_allocated_mib": m.peak_allocated_bytes / MIB,
           "gpucast/forecast_peak_reserved_mib": m.peak_reserved_bytes / MIB}
    if time_fc:
        out["gpucast/forecast_step_ms"] = float(time_fc["step_ms"])
        out["gpucast/forecast_exposed_comm_ms"] = float(time_fc["exposed_comm_ms"])
    if m.capacity_bytes:
        out["gpucast/capacity_mib"] = m.capacity_bytes / MIB
        out["gpucast/max_batch_size"] = float(m.max_batch_size)
    return out


def _params(memory) -> dict[str, str]:
    return {"gpucast_target": str(memory.target), "gpucast_batch_size": str(memory.batch_size)}


def measured_peak(reset: bool = True) -> dict[str, float]:
    """The peak since the last call: CUDA's counters when CUDA is in use, the CPU allocator's otherwise."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out = {"gpucast/measured_peak_allocated_mib": torch.cuda.max_memory_allocated() / MIB,
               "gpucast/measured_peak_reserved_mib": torch.cuda.max_memory_reserved() / MIB}
        if reset:
            torch.cuda.reset_peak_memory_stats()
        return out
    held, peak = torch.ops.gpucast.cpu_memory_stats(reset)
    return {"gpucast/measured_peak_allocated_mib": peak / MIB}


class _Adapter:
    name = "tracker"

    def forecast(self, fc_dict: dict, memory) -> None: ...
    def measured(self, values: dict[str, float], step: int) -> None: ...


class TensorBoard(_Adapter):
    name = "TensorBoard"

    def __init__(self, writer):
        self.w = writer

    def forecast(self, fc_dict, memory):
        for k, v in _scalars(memory, fc_dict.get("time")).items():
            self.w.add_scalar(k, v, 0)
        self.w.add_text("gpucast/forecast", "```\n" + json.dumps(fc_dict, indent=1) + "\n```", 0)
        self.w.add_hparams(_params(memory), {k.replace("gpucast/", "gpucast_hparam/"): v
                                             for k, v in _scalars(memory, fc_dict.get("time")).items()}, run_name="gpucast")
        self.w.flush()

    def measured(self, values, step):
        for k, v in values.items():
            self.w.add_scalar(k, v, step)
        self.w.flush()


class MLflow(_Adapter):
    name = "MLflow"

    def __init__(self, target):
        mlflow = self.mlflow = optional_import("mlflow", "logging to MLflow")
        self.run_id = target.info.run_id if hasattr(target, "info") else None
        if self.run_id is None:
            run = mlflow.active_run()
            if run is None:
                raise LookupError("MLflow has no active run: start one with mlflow.start_run()")
            self.run_id = run.info.run_id
        self.client = mlflow.MlflowClient()

    def forecast(self, fc_dict, memory):
        ts = int(time.time() * 1000)
        for k, v in _scalars(memory, fc_dict.get("time")).items():
            self.client.log_metric(self.run_id, k, v, ts, 0)
        for k, v in _params(memory).items():
            self.client.log_param(self.run_id, k, v)
        self.client.log_dict(self.run_id, fc_dict, "gpucast_forecast.json")

    def measured(self, values, step):
        ts = int(time.time() * 1000)
        for k, v in values.items():
            self.client.log_metric(self.run_id, k, v, ts, step)


class WandB(_Adapter):
    name = "Weights & Biases"

    def __init__(self, run):
        self.run = run

    def forecast(self, fc_dict, memory):
        self.run.config.update({"gpucast": fc_dict}, allow_val_change=True)
        for k, v in _scalars(memory, fc_dict.get("time")).items():
            self.run.summary[k] = v

    def measured(self, values, step):
        self.run.log(dict(values), step=step)


class JsonLines(_Adapter):
    name = "JSON Lines"

    def __init__(self, path):
        self.path = str(path)
        try:
            with open(self.path, "a", encoding="utf-8"):
                pass
        except OSError as e:
            raise OSError(f"cannot write '{self.path}': {e.strerror}") from e

    def _write(self, record):
        append_record(self.path, record)

    def forecast(self, fc_dict, memory):
        self._write({"kind": "forecast", "time": time.time(), **fc_dict})

    def measured(self, values, step):
        self._write({"kind": "measured", "time": time.time(), "step": step, **values})


def _adapter(target: Any) -> _Adapter:
    mod = type(target).__module__ or ""
    if isinstance(target, (str, os.PathLike)):
        return JsonLines(target)
    if mod.startswith("torch.utils.tensorboard") or type(target).__name__ == "SummaryWriter":
        return TensorBoard(target)
    if getattr(target, "__name__", "") == "mlflow" or mod.startswith("mlflow"):
        return MLflow(target)
    if mod.startswith("wandb"):
        return WandB(target)
    raise TypeError(f"gpucast.log_to: cannot log to {type(target).__name__}; give a SummaryWriter, the mlflow module "
                    "or an mlflow run, a wandb run, or a path for JSON Lines")


class Logger:
    """Logs forecasts to its trackers and, for the first `steps` optimizer steps, the measured peaks."""

    def __init__(self, adapters: list[_Adapter], steps: int = 5):
        self.adapters = adapters
        self.steps = steps
        self.step = 0
        self.memory = None
        self.time = None
        self._hook = None
        self._last_step_time: float | None = None

    def log_forecast(self, forecast) -> None:
        memory = getattr(forecast, "memory", forecast)
        fc_dict = forecast.to_dict() if hasattr(forecast, "to_dict") else {"memory": dict(memory.__dict__)}
        self.memory = memory
        self.time = fc_dict.get("time")
        self._each(lambda a: a.forecast(fc_dict, memory))
        self.step = 0
        self._last_step_time = time.perf_counter()
        measured_peak(reset=True)
        if self._hook is None and self.steps > 0:
            self._hook = _optimizer_module.register_optimizer_step_post_hook(self._after_step)

    def log_measured(self, step: int) -> None:
        values = measured_peak(reset=True)
        now = time.perf_counter()
        if self._last_step_time is not None:
            values["gpucast/measured_step_ms"] = (now - self._last_step_time) * 1e3
        self._last_step_time = now
        if self.memory is not None:
            values.update(_scalars(self.memory, self.time))
        self._each(lambda a: a.measured(values, step))

    def _after_step(self, optimizer, args, kwargs) -> None:
        # The hook stays registered (PyTorch's hook loop may not change while it runs) and idles after `steps`.
        if self.memory is None or self.step >= self.steps:
            return
        self.step += 1
        self.log_measured(self.step)

    def close(self) -> None:
        """Stop logging (not from inside an optimizer hook)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self in _loggers:
            _loggers.remove(self)

    def _each(self, fn) -> None:
        for a in list(self.adapters):
            try:
                fn(a)
            except Exception as e:  # noqa: BLE001 - a tracker failing must not stop training
                warn(f"gpucast: logging to {a.name} failed ({type(e).__name__}: {e}); gpucast goes on",
                     RuntimeWarning)
                self.adapters.remove(a)


_loggers: list[Logger] = []


def log_to(*targets: Any, steps: int = 5) -> Logger:
    """Log every later forecast (gpucast.forecast, auto mode, the callbacks) to these trackers."""
    adapters = []
    for t in targets:
        try:
            adapters.append(_adapter(t))
        except (ImportError, LookupError) as e:
            warn(f"gpucast.log_to: not logging to {type(t).__name__}: {e}; gpucast goes on")
    logger = Logger(adapters, steps)
    _loggers.append(logger)
    return logger


def active_trackers() -> list[_Adapter]:
    """Trackers with an active run in this process (MLflow, W&B), found without importing what is not loaded."""
    found = []
    if "mlflow" in sys.modules:
        try:
            if sys.modules["mlflow"].active_run() is not None:
                found.append(MLflow(sys.modules["mlflow"]))
        except Exception:  # noqa: BLE001
            pass
    if "wandb" in sys.modules and getattr(sys.modules["wandb"], "run", None) is not None:
        found.append(WandB(sys.modules["wandb"].run))
    return found


def publish(forecast) -> None:
    """Hand a new forecast to every Logger made by log_to()."""
    for logger in _loggers:
        logger.log_forecast(forecast)
