"""Lightning: trainer = Trainer(callbacks=[GpucastCallback(target="H100-80GB")]).

Traces the first training step, forecasts the run, warns (or raises with on_risk="raise") before the second
step when it will not fit, and logs forecast and measured peaks to the trainer's logger (TensorBoard, MLflow,
W&B) and to gpucast.log_to() targets. Acts on rank 0 only.
"""
from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:
    from pytorch_lightning.callbacks import Callback

from ._first_step import CallbackBase


def _batch_size(batch: Any) -> int:
    from .._trace import _flatten
    tensors = _flatten(batch, [])
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() > 0 else 1


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
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.is_global_zero:
            self.state.begin(_batch_size(batch))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not trainer.is_global_zero:
            return
        self.step += 1
        self.state.end(_experiments(trainer) if self.state.forecast is None else [], self.step)

    def on_exception(self, trainer, pl_module, exception):
        self.state.abort()
