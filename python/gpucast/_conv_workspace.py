"""cuDNN's workspace per convolution call at the target batch, measured on the probes' GPU.

cuDNN chooses each convolution's algorithm, and with it the workspace the call takes from the caching allocator,
by the problem's size: a probe at batch 8 can run an algorithm with a 1 MB workspace where batch 64 runs one with
55 MiB (seen on an H200). Where the probes ran on a GPU, gpucast.forecast runs each convolution module the probes
called alone, at the per-rank target batch with the probes' input shape and dtypes, forward and (where the probes
ran it) backward, under a memory trace, and takes each call's workspace as what it held above what it returned.
The forecast then models those workspaces instead of the probes'."""
from __future__ import annotations

import json
from typing import Any

import torch

_CONV_OPS = {"aten::cudnn_convolution": "forward", "aten::miopen_convolution": "forward",
             "aten::convolution_backward": "backward"}
_CONV_TYPES = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def conv_calls(trace_doc: dict) -> dict:
    """The convolution calls a probe's trace holds, by module path: the forward call's input shape and dtype and
    the weight's dtype, and whether a backward call ran and computed the input's gradient."""
    calls: dict[str, dict] = {}
    for op in trace_doc.get("ops", []):
        phase = _CONV_OPS.get(op.get("name"))
        module = op.get("module") or ""
        if phase is None or not module:
            continue
        ins = op.get("inputs") or []
        c = calls.setdefault(module, {"backward": False, "input_grad": False})
        if phase == "forward" and "input_shape" not in c and len(ins) >= 2 and ins[0].get("shape"):
            c.update(input_shape=list(ins[0]["shape"]), input_dtype=ins[0].get("dtype", ""),
                     weight_dtype=ins[1].get("dtype", ""))
        elif phase == "backward":
            c["backward"] = True
            outs = op.get("outputs") or []
            c["input_grad"] = c["input_grad"] or bool(outs and outs[0].get("shape"))
    return {m: c for m, c in calls.items() if "input_shape" in c}


def _transient(run, device: str) -> int:
    """Bytes a call held at its peak above what it held when it returned, from a memory trace around it."""
    from ._trace import trace
    with trace(record_shapes=False, device_timing=False) as t:
        kept = run()
    # Bytes by category held on the device, from the start (what the process held before, listed block by
    # block: parameters, cuBLAS workspaces) and after each event: the call's peak over what it returned.
    held = [sum(b) for b in json.loads(t.result.handle.memory_series(device)).get("bytes") or [[0]]]
    del kept
    return max(0, max(held) - held[-1])


def measure(model: torch.nn.Module, calls: dict, per_rank_batch: int, device: str) -> tuple[dict, list]:
    """{"<module>|forward": bytes, "<module>|backward": bytes} for the convolution modules of `model` the probes
    called (`calls`, from conv_calls), each run alone at `per_rank_batch` on `device`; and the calls not measured,
    each with why (a module that is not a plain torch.nn.ConvNd, or out of memory). The model's parameters and
    the RNG state are left as they were."""
    root = type(model).__name__
    modules = {f"{root}.{n}" if n else root: m for n, m in model.named_modules()}
    out: dict[str, int] = {}
    skipped: list[str] = []
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
              "float64": torch.float64}
    for path, c in calls.items():
        m = modules.get(path)
        if not isinstance(m, _CONV_TYPES) or m.padding_mode != "zeros":
            skipped.append(f"{path} (not a torch.nn.ConvNd with zero padding)")
            continue
        x_dtype = dtypes.get(c["input_dtype"], m.weight.dtype)
        w_dtype = dtypes.get(c["weight_dtype"], m.weight.dtype)
        shape = [per_rank_batch] + list(c["input_shape"][1:])
        fn = (torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d)[len(shape) - 3]
        try:
            with torch.no_grad():
                x = torch.zeros(shape, dtype=x_dtype, device=device)
                w = m.weight.detach().to(w_dtype)
                b = None if m.bias is None else m.bias.detach().to(w_dtype)
            args = (m.stride, m.padding, m.dilation, m.groups)
            with torch.no_grad():
                out[f"{path}|forward"] = _transient(lambda: fn(x, w, b, *args), device)
            if c["backward"]:
                x.requires_grad_(c["input_grad"])
                w.requires_grad_(True)
                if b is not None:
                    b.requires_grad_(True)
                with torch.enable_grad():
                    y = fn(x, w, b, *args)
                gy = torch.ones_like(y)
                inputs = [t for t in (x, w, b) if t is not None and t.requires_grad]
                out[f"{path}|backward"] = _transient(lambda: torch.autograd.grad(y, inputs, gy), device)
                del y, gy, inputs
            del x, w, b
        except torch.OutOfMemoryError:
            skipped.append(f"{path} (out of memory)")
    return out, skipped


def measure_quietly(model: Any, trace_doc: dict, per_rank_batch: int, device: str) -> tuple[dict, list]:
    """measure() from a probe's trace document; any failure leaves the forecast to the probes' workspaces."""
    try:
        return measure(model, conv_calls(trace_doc), per_rank_batch, device)
    except Exception as e:  # the forecast must not fail for this: it reports the headroom instead
        return {}, [f"every call ({type(e).__name__}: {e})"]
