"""Lightning: trainer = Trainer(callbacks=[GpucastCallback(target="H100-80GB")]).

At train start, probes training_step on slices of the first batch and forecasts the run; warns (or raises with
on_risk="raise") before the first full step when it will not fit (where probing cannot run, it traces the first
step and judges before the second). Logs through every logger of the trainer (trainer.loggers), with Lightning's
own logger API, so any Lightning logger gets the values (CSV, TensorBoard, MLflow, W&B, ...): the forecast's target
and batch size as hyperparameters (log_hyperparams), its peaks and capacity as metrics at step 0, and the measured
peaks of the first steps beside them (log_metrics); also to gpucast.log_to() targets. Acts on rank 0 only.
"""
from __future__ import annotations

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:
    from pytorch_lightning.callbacks import Callback

from .. import trackers
from ._first_step import CallbackBase, batch_size_of

# Loggers whose runs gpucast would otherwise also find by itself (trackers.active_trackers): logged once, here.
_RUNS = {"MLFlowLogger": "MLflow", "WandbLogger": "Weights & Biases"}


class LightningLogger(trackers._Adapter):
    """A Lightning logger, through its own API (log_hyperparams, log_metrics, save)."""

    def __init__(self, logger):
        self.logger = logger
        self.name = type(logger).__name__

    def forecast(self, fc_dict, memory):
        self.logger.log_hyperparams(trackers._params(memory))
        self.logger.log_metrics(trackers._scalars(memory, fc_dict.get("time")), step=0)
        self.logger.save()

    def measured(self, values, step):
        self.logger.log_metrics(dict(values), step=step)
        self.logger.save()


def _loggers(trainer) -> list[LightningLogger]:
    return [LightningLogger(x) for x in getattr(trainer, "loggers", []) or []]


class GpucastCallback(CallbackBase, Callback):
    def on_train_start(self, trainer, pl_module):
        if not trainer.is_global_zero or not trainer.optimizers:
            return
        self.state.skip_active = {_RUNS[x.name] for x in _loggers(trainer) if x.name in _RUNS}
        first = trainer.strategy.batch_to_device(next(iter(trainer.train_dataloader)))
        opt = trainer.optimizers[0]

        def step(batch):
            opt.zero_grad(set_to_none=True)
            out = pl_module.training_step(batch, 0)
            loss = out["loss"] if isinstance(out, dict) else out
            loss.backward()
            opt.step()

        self.state.at_train_start(step, first, pl_module, opt, _loggers(trainer))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.is_global_zero:
            self.state.begin(batch_size_of(batch))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not trainer.is_global_zero:
            return
        self.step += 1
        self.state.end(_loggers(trainer) if self.state.forecast is None else [], self.step)

    def on_exception(self, trainer, pl_module, exception):
        self.state.abort()
