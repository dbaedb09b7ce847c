"""What both framework callbacks do: trace the first training step, forecast the run from it, warn (or raise)
on out-of-memory risk before the second step, and log the forecast and the measured peaks of the first steps."""
from __future__ import annotations

import warnings
from typing import Any

from .. import trackers
from .._auto import forecast_traced_step, judge
from .._forecast import Forecast
from .._trace import trace


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
        self.forecast = Forecast(memory=memory, probe_batch_sizes=(self.batch,), probe_device="", context={})
        adapters = []
        for t in framework_trackers + self.extra_targets:
            try:
                adapters.append(trackers._adapter(t))
            except (TypeError, ImportError, LookupError) as e:
                warnings.warn(f"gpucast: not logging to {type(t).__name__}: {e}; gpucast goes on", stacklevel=3)
        adapters += trackers.active_trackers()
        self.logger = trackers.Logger(adapters, steps=0)  # measured values are logged by end()
        self.logger.log_forecast(self.forecast)
        trackers.publish(self.forecast)
        self.logger.log_measured(step)
        judge(memory, self.capacity_mb, self.warn_fraction, self.on_risk, stacklevel=4)
        return self.forecast

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
