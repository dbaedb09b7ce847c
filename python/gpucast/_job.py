"""gpucast.describe(): a job description a scheduler can read; gpucast.predict_job(): its memory estimate."""
from __future__ import annotations

import json
from typing import Any, Callable

import torch

from ._trace import _flatten, trace

_KINDS = [  # (module classes, kind), first match wins
    ((torch.nn.Linear, torch.nn.Bilinear), "linear"),
    ((torch.nn.modules.conv._ConvNd,), "conv"),
    ((torch.nn.modules.batchnorm._NormBase, torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.RMSNorm), "norm"),
    ((torch.nn.Embedding, torch.nn.EmbeddingBag), "embedding"),
    ((torch.nn.MultiheadAttention,), "attention"),
    ((torch.nn.RNNBase,), "rnn"),
    ((torch.nn.ReLU, torch.nn.GELU, torch.nn.SiLU, torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.Hardswish,
      torch.nn.Hardsigmoid, torch.nn.LeakyReLU, torch.nn.Softmax), "activation"),
    ((torch.nn.modules.pooling._MaxPoolNd, torch.nn.modules.pooling._AvgPoolNd,
      torch.nn.modules.pooling._AdaptiveAvgPoolNd, torch.nn.modules.pooling._AdaptiveMaxPoolNd), "pool"),
    ((torch.nn.modules.dropout._DropoutNd,), "dropout"),
]


def _kind(m: torch.nn.Module) -> str:
    for classes, kind in _KINDS:
        if isinstance(m, classes):
            return kind
    name = type(m).__name__.lower()
    return "attention" if "attention" in name else "other"


def _dims(m: torch.nn.Module) -> list[int]:
    if isinstance(m, torch.nn.Linear):
        return [m.in_features, m.out_features]
    if isinstance(m, torch.nn.modules.conv._ConvNd):
        return [m.in_channels, m.out_channels, *m.kernel_size]
    if isinstance(m, torch.nn.Embedding):
        return [m.num_embeddings, m.embedding_dim]
    if isinstance(m, torch.nn.RNNBase):
        return [m.input_size, m.hidden_size, m.num_layers]
    if isinstance(m, torch.nn.modules.batchnorm._NormBase):
        return [m.num_features]
    if isinstance(m, torch.nn.LayerNorm):
        return list(m.normalized_shape)
    return []


def _optimizer_name(opt) -> str:
    if opt is None:
        return "adamw"
    if isinstance(opt, torch.optim.SGD):
        return "sgd_momentum" if any(g.get("momentum", 0) for g in opt.param_groups) else "sgd"
    if isinstance(opt, torch.optim.AdamW):
        return "adamw"
    if isinstance(opt, torch.optim.Adam):
        return "adam"
    if isinstance(opt, getattr(torch.optim, "Adafactor", ())):
        return "adafactor"
    return "other"


def _family(kinds: set[str], seq_len: int) -> str:
    if "rnn" in kinds:
        return "rnn"
    if "attention" in kinds or ("embedding" in kinds and seq_len):
        return "transformer-decoder" if seq_len else "transformer-encoder"
    if "conv" in kinds:
        return "cnn"
    return "mlp"


def describe(model: torch.nn.Module, make_batch: Callable[[int], Any], batch_size: int, *,
             optimizer: torch.optim.Optimizer | None = None, loss_fn: Callable | None = None,
             probe_batch: int = 2, family: str | None = None, world_size: int = 1, strategy: str = "single",
             grad_accumulation: int = 1, activation_checkpointing: bool = False) -> dict:
    """The job description (schema version 2): layers with kinds, dimensions, parameters and the activation
    bytes per sample each saves for backward (measured with one traced forward and backward at `probe_batch`),
    batch, sequence length or input shape, dtype, optimizer, strategy. Gradients of the probe are discarded."""
    batch = make_batch(probe_batch)
    inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
    first = _flatten(inputs, [])[0]
    seq_len = int(first.shape[1]) if first.dim() == 2 and not first.is_floating_point() else 0
    with trace() as t:
        out = model(inputs)
        loss = loss_fn(out, batch[1]) if loss_fn is not None else sum(x.float().sum() for x in _flatten(out, []))
        loss.backward()
    model.zero_grad(set_to_none=True)
    root = type(model).__name__
    per_module: dict[str, int] = json.loads(t.result._h.activation_bytes_by_module())
    layers = []
    for name, m in model.named_modules():
        if any(True for _ in m.children()):
            continue
        path = f"{root}.{name}" if name else root
        layers.append({"kind": _kind(m), "name": path, "dims": _dims(m),
                       "params": sum(p.numel() for p in m.parameters(recurse=False)),
                       "activation_bytes_per_sample": per_module.get(path, 0) // probe_batch})
    # Activations made outside leaf modules (functional calls in a parent's forward) go to an "other" layer.
    leaf = {x["name"] for x in layers}
    rest = sum(v for k, v in per_module.items() if k not in leaf)
    if rest:
        layers.append({"kind": "other", "name": f"{root} (outside leaf modules)", "dims": [], "params": 0,
                       "activation_bytes_per_sample": rest // probe_batch})
    in_tensors = _flatten(inputs, [])
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    return {"schema_version": 2, "family": family or _family({x["kind"] for x in layers}, seq_len),
            "layers": layers, "batch_size": int(batch_size), "seq_len": seq_len,
            "input_shape": list(first.shape[1:]),
            "input_bytes_per_sample": sum(x.numel() * x.element_size() for x in in_tensors) // probe_batch,
            "dtype": dtype, "autocast": False, "optimizer": _optimizer_name(optimizer),
            "grad_accumulation": grad_accumulation, "activation_checkpointing": activation_checkpointing,
            "world_size": world_size, "strategy": strategy}


def describe_config(config: dict | str, batch_size: int, *, seq_len: int | None = None, dtype: str = "float32",
                    optimizer: str = "adamw", grad_accumulation: int = 1, activation_checkpointing: bool = False,
                    world_size: int = 1, strategy: str = "single", tp: int = 1, pp: int = 1, micro_batches: int = 1,
                    target: str = "", attn_implementation: str = "sdpa") -> dict:
    """The job description (schema version 2) of a transformers model from its config.json (a dict, or the path to
    the file) and the job's settings, without building the model: the layers transformers builds for the config's
    model_type with their exact parameter counts, and the activations each saves per sample at `seq_len` (text
    models). `world_size` counts every rank (data-parallel x tp x pp); `strategy` is the data-parallel mode.
    ValueError naming the file and field for a config or setting gpucast cannot use (model types: the error lists
    them)."""
    source = config if isinstance(config, str) else "config"
    text = json.dumps(config) if isinstance(config, dict) else _file_text(config)
    settings = {"batch_size": batch_size, "dtype": dtype, "optimizer": optimizer,
                "grad_accumulation": grad_accumulation, "activation_checkpointing": activation_checkpointing,
                "world_size": world_size, "strategy": strategy, "tp": tp, "pp": pp, "micro_batches": micro_batches,
                "target": target, "attn_implementation": attn_implementation}
    if seq_len is not None:
        settings["seq_len"] = seq_len
    return json.loads(torch.ops.gpucast.job_from_hf_config(text, json.dumps(settings), source=str(source)))


def _file_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise OSError(f"cannot read '{path}': {e.strerror}") from e
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 at byte {e.start} ({e.reason})") from None


def _job_text(job: dict | str) -> str:
    if isinstance(job, dict):
        return json.dumps(job)
    if isinstance(job, str) and job.lstrip().startswith("{"):
        return job
    return _file_text(job)


def predict_job(job: dict | str, weights: str | None = None) -> dict:
    """Peak memory of one rank from a job description (dict, JSON text, or a path to a JSON file).

    The learned model (BiGRU-optimized Transformer) answers when its weights load: `weights`, else
    $GPUCAST_JOB_WEIGHTS, else the weights shipped with gpucast. When they are missing, truncated or of another
    version, the analytical estimate answers instead and result["notes"][0] says why (code "learned-unavailable";
    "learned-implausible" when its answer is not within 0.25x-4x of the analytical one); result["method"] is
    "learned" or "analytical". Each note is {"code", "text"}: act on the code, the text may be reworded. A bad job description raises ValueError naming the field."""
    text = _job_text(job)
    source = job if isinstance(job, str) and not job.lstrip().startswith("{") else "job"
    return json.loads(torch.ops.gpucast.predict_job(text, weights, source=str(source)))
