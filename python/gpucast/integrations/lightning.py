"""Lightning: trainer = Trainer(callbacks=[GpucastCallback(target="H100-80GB")]).

At train start, probes training_step on slices of the first batch and forecasts the run; warns (or raises with
on_risk="raise") before the first full step when it will not fit (where probing cannot run, it traces the first
step and judges before the second); logs forecast and measured peaks to the trainer's logger (TensorBoard, MLflow,
W&B) and to gpucast.log_to() targets. Acts on rank 0 only.
"""
from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:
    from pytorch_lightning.callbacks import Callback

from ._first_step import CallbackBase, batch_size_of


def _experiments(trainer) -> list:
    out = []
    for logger in getattr(trainer, "loggers", []) or []:
        exp = getattr(logger, "experiment", None)
        name = type(logger).__name__
        if name == "MLFlowLogger":
            import mlflow
            out.append(mlflow.tracking.MlflowClient(tracking_uri=logger._tracking_uri).get_run(logger.run_id))
        elif exp is not None:
            out.append(exp)
    return out


class GpucastCallback(CallbackBase, Callback):
    def on_train_start(self, trainer, pl_module):
        if not trainer.is_global_zero or not trainer.optimizers:
            return
        first = trainer.strategy.batch_to_device(next(iter(trainer.train_dataloader)))
        opt = trainer.optimizers[0]

        def step(batch):
            opt.zero_grad(set_to_none=True)
            out = pl_module.training_step(batch, 0)
            loss = out["loss"] if isinstance(out, dict) else out
            loss.backward()
            opt.step()

        self.state.at_train_start(step, first, pl_module, opt, _experiments(trainer))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.is_global_zero:
            self.state.begin(batch_size_of(batch))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not trainer.is_global_zero:
            return
        self.step += 1
        self.state.end(_experiments(trainer) if self.state.forecast is None else [], self.step)

    def on_exception(self, trainer, pl_module, exception):
        self.state.abort()
