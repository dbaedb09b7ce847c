"""Hugging Face: Trainer(..., callbacks=[GpucastCallback(target="H100-80GB")]).

Traces the first training step, forecasts the run, warns (or raises with on_risk="raise") before the second
step when it will not fit, logs forecast and measured peaks to trackers with an active run (MLflow, W&B) and
gpucast.log_to() targets, and records them in trainer.state.log_history. Acts on the main process only.
"""
from __future__ import annotations

from transformers import TrainerCallback

from ._first_step import CallbackBase


class GpucastCallback(CallbackBase, TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            batch = args.per_device_train_batch_size * max(1, args.gradient_accumulation_steps)
            self.state.begin(batch)

    def on_step_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        self.step += 1
        fc = self.state.end([], self.step)
        if fc is not None:
            m = fc.memory
            state.log_history.append({"step": state.global_step,
                                      "gpucast/forecast_peak_allocated_bytes": m.peak_allocated_bytes,
                                      "gpucast/forecast_peak_reserved_bytes": m.peak_reserved_bytes,
                                      "gpucast/target": m.target})
