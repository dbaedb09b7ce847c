"""Hugging Face: Trainer(..., callbacks=[GpucastCallback(target="H100-80GB")]).

At train start, probes the model on slices of the first batch and forecasts the run; warns (or raises with
on_risk="raise") before the first full step when it will not fit (where probing cannot run, it traces the first
step and judges before the second). Acts on the main process only.

Where the values go: every reporter of the Trainer (report_to: TensorBoard, MLflow, W&B, Comet, ...) and any other
callback with an on_log gets them as an on_log event of their own, with numbers only: the forecast's peaks and
capacity (gpucast/forecast_*_mib, ...) when it is made, and the measured peaks of the first steps beside them
(gpucast/measured_*) at each of those steps; the reporters log them at state.global_step as they log the loss
(TensorBoard under train/gpucast/...). Also to gpucast.log_to() targets, to MLflow and W&B runs the reporters do
not hold, and the forecast in bytes in trainer.state.log_history.

Why an event of its own: the Trainer puts the reporters before the user's callbacks (Trainer.__init__:
DEFAULT_CALLBACKS + get_reporting_integration_callbacks(report_to) + callbacks) and CallbackHandler.call_event
calls them in that order with the same `logs` dict, so values added to `logs` in this callback's on_log would reach
only the callbacks after it; and the Trainer logs only every logging_steps steps, so the first steps' peaks would
never be logged. The Trainer's CallbackHandler is the object calling this callback (no event hands over the
trainer): the callback takes it from the calling frame and calls each callback's on_log with the arguments
call_event gives (not the handler's on_log, which would reset control.should_log for the step). The progress
printers (ProgressCallback, PrinterCallback, NotebookProgressCallback) are left out: the values are not printed.
"""
from __future__ import annotations

import sys

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler

from .. import trackers
from ._first_step import CallbackBase
from .._warnings import warn

_PRINTERS = {"ProgressCallback", "PrinterCallback", "NotebookProgressCallback"}
# Reporters whose runs gpucast would otherwise also find by itself (trackers.active_trackers): logged once.
_RUNS = {"MLflowCallback": "MLflow", "WandbCallback": "Weights & Biases"}


def _names(cb) -> set[str]:
    return {c.__name__ for c in type(cb).__mro__}


class Reporters(trackers._Adapter):
    """The Trainer's callbacks, each handed an on_log event with gpucast's values."""

    name = "the Trainer's reporters"

    def __init__(self, handler: CallbackHandler | None, owner: TrainerCallback):
        self.handler, self.owner = handler, owner
        self.args = self.state = self.control = None
        self.failed: set[int] = set()

    def forecast(self, fc_dict, memory):
        self._log(trackers._scalars(memory, fc_dict.get("time")))

    def measured(self, values, step):
        self._log(values)

    def _log(self, values: dict) -> None:
        h = self.handler
        for cb in list(h.callbacks) if h is not None else []:
            if cb is self.owner or id(cb) in self.failed or _names(cb) & _PRINTERS:
                continue
            try:
                cb.on_log(self.args, self.state, self.control, model=h.model, processing_class=h.processing_class,
                          optimizer=h.optimizer, lr_scheduler=h.lr_scheduler, train_dataloader=h.train_dataloader,
                          eval_dataloader=h.eval_dataloader, logs=dict(values))
            except Exception as e:  # noqa: BLE001 - a reporter failing must not stop training
                self.failed.add(id(cb))
                warn(f"gpucast: logging to {type(cb).__name__} failed ({type(e).__name__}: {e}); gpucast goes on",
                     RuntimeWarning)


def _calling_handler(owner) -> CallbackHandler | None:
    """The CallbackHandler whose call_event is calling `owner` (a few frames up)."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return None
        h = frame.f_locals.get("self")
        if isinstance(h, CallbackHandler) and any(cb is owner for cb in h.callbacks):
            return h
        frame = frame.f_back
    return None


class GpucastCallback(CallbackBase, TrainerCallback):
    _reporters: Reporters | None = None
    _recorded = False

    def _bind(self, args, state, control) -> list:
        """[the reporters adapter], holding this event's arguments (it logs nowhere where no handler was found)."""
        if self._reporters is None:
            handler = _calling_handler(self)
            if handler is None:
                warn("gpucast: GpucastCallback is not called by a transformers CallbackHandler: the "
                     "Trainer's reporters do not get gpucast's values; gpucast goes on", RuntimeWarning)
            else:
                self.state.skip_active = {_RUNS[n] for cb in handler.callbacks for n in _names(cb) if n in _RUNS}
            self._reporters = Reporters(handler, self)
        r = self._reporters
        r.args, r.state, r.control = args, state, control
        return [r]

    def on_train_begin(self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kwargs):
        if not state.is_world_process_zero or model is None or optimizer is None or train_dataloader is None:
            return
        reporters = self._bind(args, state, control)
        device = next(model.parameters()).device
        first = {k: v.to(device) if hasattr(v, "to") else v for k, v in next(iter(train_dataloader)).items()}

        def step(batch):
            model.train()
            optimizer.zero_grad(set_to_none=True)
            model(**batch).loss.backward()
            optimizer.step()

        self.state.at_train_start(step, first, model, optimizer, reporters)
        self._record(state)

    def _record(self, state) -> None:
        fc = self.state.forecast
        if fc is None or self._recorded:
            return
        self._recorded = True
        m = fc.memory
        state.log_history.append({"step": state.global_step,
                                  "gpucast/forecast_peak_allocated_bytes": m.peak_allocated_bytes,
                                  "gpucast/forecast_peak_reserved_bytes": m.peak_reserved_bytes,
                                  "gpucast/target": m.target})

    def on_step_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            batch = args.per_device_train_batch_size * max(1, args.gradient_accumulation_steps)
            self.state.begin(batch)

    def on_step_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        self.step += 1
        reporters = self._bind(args, state, control)
        self.state.end(reporters if self.state.forecast is None else [], self.step)
        self._record(state)
