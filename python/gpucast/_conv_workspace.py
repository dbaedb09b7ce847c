"""cuDNN's workspace per convolution call at the target batch, measured on the probes' GPU.

cuDNN chooses each convolution's algorithm, and with it its workspace, by the problem's size, so that probes at small
batches cannot show the target's. Where the probes ran on a GPU, gpucast.forecast runs each convolution module the
probes called alone at the per-rank target batch, forward and (where the probes ran it) backward, and the forecast
models those workspaces instead of the probes'. Which calls, at which shapes, and how a call's workspace is measured
live in C++ (predictor/include/gpucast/workspace_calls.h, plugin/ops_workspace.cpp); this adapter only picks the
modules out of the model, which only Python holds."""
from __future__ import annotations

import json
from typing import Any

import torch

_CONV_TYPES = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def conv_calls(probe: Any) -> dict:
    """The convolution calls a probe's trace (torch.classes.gpucast.Trace) holds, by module path: the forward call's
    input shape and dtype and the weight's dtype, and whether a backward call ran and computed the input's
    gradient."""
    return json.loads(torch.ops.gpucast.conv_calls(probe))


def measure(model: torch.nn.Module, calls: dict, per_rank_batch: int, device: str) -> tuple[dict, list]:
    """{"<module>|forward": bytes, "<module>|backward": bytes} for the convolution modules of `model` the probes
    called (`calls`, from conv_calls), each run alone at `per_rank_batch` on `device`; and the calls not measured,
    each with why (a module that is not a plain torch.nn.ConvNd, or out of memory). The model's parameters and
    the RNG state are left as they were."""
    root = type(model).__name__
    modules = {f"{root}.{n}" if n else root: m for n, m in model.named_modules()}
    geometry: dict[str, dict] = {}
    weights: dict[str, torch.Tensor] = {}
    biases: dict[str, torch.Tensor] = {}
    for path in calls:
        m = modules.get(path)
        if isinstance(m, _CONV_TYPES) and m.padding_mode == "zeros":  # the op runs torch.nn.functional.convNd
            geometry[path] = {"stride": list(m.stride), "dilation": list(m.dilation), "groups": m.groups,
                              "padding": m.padding if isinstance(m.padding, str) else list(m.padding)}
            weights[path] = m.weight
            if m.bias is not None:
                biases[path] = m.bias
    ws, skipped = torch.ops.gpucast.measure_conv_workspaces(json.dumps(calls), per_rank_batch, device,
                                                            json.dumps(geometry), weights, biases)
    return dict(ws), list(skipped)


def measure_quietly(model: Any, calls: dict, per_rank_batch: int, device: str) -> tuple[dict, list]:
    """measure(); any failure leaves the forecast to the probes' workspaces."""
    try:
        return measure(model, calls, per_rank_batch, device)
    except Exception as e:  # the forecast must not fail for this: it reports the headroom instead
        return {}, [f"every call ({type(e).__name__}: {e})"]
