"""What both framework callbacks do: at train start, probe the training step on slices of the first batch
and forecast the run; warn (or raise) on out-of-memory risk before the first full step; log the forecast and
the measured peaks of the first steps. Where probing cannot run, they trace the first step instead and judge
before the second."""
from __future__ import annotations

from typing import Any

from .. import trackers
from .._auto import forecast_traced_step, judge
from .._forecast import forecast
from .._results import Forecast
from .._trace import _flatten, trace
from .._warnings import warn


def slice_batch(batch: Any, n: int) -> Any:
    """The first n samples of a batch (tensors sliced along their first dimension, structure kept)."""
    import torch
    if isinstance(batch, torch.Tensor):
        return batch[:n] if batch.dim() > 0 else batch
    if isinstance(batch, (list, tuple)):
        return type(batch)(slice_batch(x, n) for x in batch) if not hasattr(batch, "_fields") else \
            type(batch)(*(slice_batch(x, n) for x in batch))
    if isinstance(batch, dict):
        return type(batch)((k, slice_batch(v, n)) for k, v in batch.items())
    return batch


def batch_size_of(batch: Any) -> int:
    tensors = _flatten(batch, [])
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() > 0 else 1


def probe_sizes(full: int) -> tuple:
    sizes = sorted({s for s in (2, 4, 8) if s < full}) if full > 8 else sorted({max(1, full // 4), max(1, full // 2), full})
    return tuple(sizes)


def _auto_target(target: str) -> str:
    from .._auto import _resolve_target
    return _resolve_target(target)


class FirstStep:
    def __init__(self, target: str = "auto", capacity_mb: int = 0, warn_fraction: float = 0.9, on_risk: str = "warn",
                 log: list | None = None, steps: int = 5):
        if on_risk not in ("warn", "raise"):
            raise ValueError(f"GpucastCallback: on_risk expects warn or raise, got {on_risk!r}")
        if not 0.0 < warn_fraction <= 1.0:
            raise ValueError(f"GpucastCallback: warn_fraction expects a number in (0, 1], got {warn_fraction!r}")
        self.target, self.capacity_mb, self.warn_fraction, self.on_risk = target, capacity_mb, warn_fraction, on_risk
        self.extra_targets = list(log or [])
        self.steps = steps
        self.trace: trace | None = None
        self.batch = 1
        self.forecast: Forecast | None = None
        self.logger: trackers.Logger | None = None
        self.measured: list[dict] = []
        # Names of trackers (trackers.active_trackers) the framework already logs to: not logged to twice.
        self.skip_active: set[str] = set()

    def at_train_start(self, step, first_batch: Any, model, optimizer, framework_trackers: list[Any]) -> None:
        """Probe on slices of the first batch and forecast before any full step; on failure, trace the first step."""
        full = batch_size_of(first_batch)
        try:
            fc = forecast(step, lambda n: slice_batch(first_batch, n), full, model=model, optimizer=optimizer,
                          target=_auto_target(self.target), capacity=self.capacity_mb * 2**20 or None,
                          safety_fraction=self.warn_fraction, probe_batch_sizes=probe_sizes(full))
        except Exception as e:  # noqa: BLE001 - the job's own step failing here must not stop training
            warn(f"gpucast: probing the training step failed ({type(e).__name__}: {e}); forecasting from "
                 "the first step instead", RuntimeWarning)
            return
        self._publish(fc, framework_trackers, step=0)

    def _publish(self, fc: Forecast, framework_trackers: list[Any], step: int) -> None:
        self.forecast = fc
        adapters = []
        for t in framework_trackers + self.extra_targets:
            try:
                adapters.append(t if isinstance(t, trackers._Adapter) else trackers._adapter(t))
            except (TypeError, ImportError, LookupError) as e:
                warn(f"gpucast: not logging to {type(t).__name__}: {e}; gpucast goes on")
        adapters += [a for a in trackers.active_trackers() if a.name not in self.skip_active]
        self.logger = trackers.Logger(adapters, steps=0)  # measured values are logged by end()
        self.logger.log_forecast(fc)
        if step > 0:
            self.logger.log_measured(step)
        judge(fc.memory, self.capacity_mb, self.warn_fraction, self.on_risk)

    def begin(self, batch_size: int) -> None:
        if self.trace is not None or self.forecast is not None:
            return
        self.batch = max(1, int(batch_size))
        self.trace = trace()
        self.trace.__enter__()

    def end(self, framework_trackers: list[Any], step: int) -> Forecast | None:
        """After an optimizer step: the first time, forecast and judge; then log measured peaks."""
        if self.forecast is not None:
            if self.logger is not None and step <= self.steps:
                self.logger.log_measured(step)
                self.measured.append(trackers.measured_peak(reset=False))
            return None
        if self.trace is None:
            return None
        self.trace.__exit__(None, None, None)
        memory = forecast_traced_step(self.trace.result, self.batch, self.target, self.capacity_mb, self.warn_fraction)
        self.trace = None
        fc = Forecast(memory=memory, probe_batch_sizes=(self.batch,), probe_device="", context={})
        trackers.publish(fc)
        self._publish(fc, framework_trackers, step)
        return fc

    def abort(self) -> None:
        if self.trace is not None:
            self.trace.__exit__(None, None, None)
            self.trace = None


class CallbackBase:
    """What the framework callbacks share: their options and the forecast they made."""

    def __init__(self, target: str = "auto", capacity_mb: int = 0, warn_fraction: float = 0.9, on_risk: str = "warn",
                 log: list | None = None, steps: int = 5):
        self.state = FirstStep(target, capacity_mb, warn_fraction, on_risk, log, steps)
        self.step = 0

    @property
    def forecast(self) -> Forecast | None:
        return self.state.forecast
