"""Hugging Face: Trainer(..., callbacks=[GpucastCallback(target="H100-80GB")]).

At train start, probes the model on slices of the first batch and forecasts the run; warns (or raises with
on_risk="raise") before the first full step when it will not fit (where probing cannot run, it traces the first
step and judges before the second); logs forecast and measured peaks to trackers with an active run (MLflow, W&B) and
gpucast.log_to() targets, and records them in trainer.state.log_history. Acts on the main process only.
"""
from __future__ import annotations

from transformers import TrainerCallback

from ._first_step import CallbackBase


class GpucastCallback(CallbackBase, TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kwargs):
        if not state.is_world_process_zero or model is None or optimizer is None or train_dataloader is None:
            return
        device = next(model.parameters()).device
        first = {k: v.to(device) if hasattr(v, "to") else v for k, v in next(iter(train_dataloader)).items()}

        def step(batch):
            model.train()
            optimizer.zero_grad(set_to_none=True)
            model(**batch).loss.backward()
            optimizer.step()

        self.state.at_train_start(step, first, model, optimizer, [])
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

    _recorded = False

    def on_step_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            batch = args.per_device_train_batch_size * max(1, args.gradient_accumulation_steps)
            self.state.begin(batch)

    def on_step_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        self.step += 1
        self.state.end([], self.step)
        self._record(state)
