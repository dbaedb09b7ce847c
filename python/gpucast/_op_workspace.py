"""The scratch of each matrix multiply at the target batch, measured on the CPU.

On the CPU, oneDNN runs 16-bit matrix multiplies (and PyTorch's other CPU kernels some 32-bit ones) with a
scratchpad taken from PyTorch's allocator inside the call, sized by the blocking it chooses for the problem: not in
proportion to the batch (a ViT's weight-gradient multiply at batch 16 takes 197,760 bytes, at batch 32 865,408), so
probes at small batches cannot show it. For a CPU target from CPU probes, gpucast.forecast runs each matrix-multiply
call of the largest probe alone at the target batch, its inputs' shapes extrapolated from the two largest probes
(a dimension that grows with the batch grows linearly: rows = batch x tokens), with the probes' dtypes and layouts,
under a memory trace, and takes as its scratch what it held above what it returned. The forecast then models those
scratches instead of the probes'. Calls whose shapes do not extrapolate, or whose operands would take more than
`max_bytes`, keep the probes' scratch, scaled."""
from __future__ import annotations

import json
from typing import Any

import torch

from ._conv_workspace import _transient

_MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64}


def _extrapolate(ref: list, prev: list, ref_batch: int, prev_batch: int, batch: int) -> list | None:
    """The shape at `batch` from the shapes at the two probes' batches, or None where a dimension does not grow
    by a whole number per sample."""
    if len(ref) != len(prev) or ref_batch == prev_batch:
        return None
    out = []
    for r, p in zip(ref, prev):
        step = (r - p) * (batch - ref_batch)
        if step % (ref_batch - prev_batch) != 0:
            return None
        d = r + step // (ref_batch - prev_batch)
        if d < 1:
            return None
        out.append(d)
    return out


def _strides(shape: list, recorded: list) -> list:
    """Dense strides for `shape` in the recorded layout's order of dimensions (a transposed operand stays
    transposed; a broadcast dimension keeps its stride 0)."""
    order = sorted(range(len(shape)), key=lambda i: (-recorded[i], -i))
    strides = [0] * len(shape)
    step = 1
    for i in reversed(order):
        if recorded[i] == 0:
            continue
        strides[i] = step
        step *= shape[i]
    return strides


def _matmuls(doc: dict) -> list:
    """(op index, op) of the matrix-multiply calls not nested in another, in order, from Trace.ops_json(_MATMULS)'s
    document (each op with its index, id, and its parent's name)."""
    return [(op["id"], op) for op in doc.get("ops", [])
            if op.get("name") in _MATMULS and op.get("parent_name") not in _MATMULS]


def matmul_calls(ref_doc: dict, prev_doc: dict, ref_batch: int, prev_batch: int, batch: int) -> tuple[dict, list]:
    """{op index in ref_doc: (name, [(shape, strides, dtype) per operand])} at `batch` for the CPU matrix-multiply
    calls of the largest probe (not nested in another), matched in order with the other probe's (the same calls
    of the same modules, whatever else the probes ran); and the calls left out, each with why."""
    ref, prev = _matmuls(ref_doc), _matmuls(prev_doc)
    key = lambda op: (op.get("name"), op.get("module"), op.get("phase"))
    if [key(op) for _, op in ref] != [key(op) for _, op in prev]:
        return {}, [f"every call (the probes' matrix multiplies differ: {len(ref)} and {len(prev)} calls)"]
    calls: dict[int, tuple] = {}
    skipped: list[str] = []
    for (i, op), (_, other) in zip(ref, prev):
        tensors = [x for x in op.get("inputs") or [] if x.get("kind") == "tensor"]
        if not tensors or any(x.get("device") != "cpu" or x.get("dtype") not in _DTYPES or "strides" not in x
                              for x in tensors):
            continue
        other_tensors = [x for x in other.get("inputs") or [] if x.get("kind") == "tensor"]
        operands = []
        if len(other_tensors) == len(tensors):
            for x, y in zip(tensors, other_tensors):
                shape = _extrapolate(list(x["shape"]), list(y.get("shape") or []), ref_batch, prev_batch, batch)
                if shape is None:
                    break
                operands.append((shape, _strides(shape, list(x["strides"])), x["dtype"]))
        if len(operands) != len(tensors):
            skipped.append(f"{op.get('name')} of {op.get('module') or 'no module'} (its shapes do not scale with "
                           f"the batch)")
            continue
        calls[i] = (op.get("name"), operands)
    return calls, skipped


def _nbytes(shape: list, strides: list, dtype: torch.dtype) -> int:
    extent = 1 + sum((d - 1) * s for d, s in zip(shape, strides))
    return extent * torch.empty((), dtype=dtype).element_size()


def _flops(operands: list) -> int:
    """Multiply-adds x 2 of a call whose last two operands are the multiplied ones ([..., m, k] @ [..., k, n])."""
    a, b = operands[-2][0], operands[-1][0]
    n = 2 * b[-1]
    for d in a:
        n *= d
    return n


def measure(calls: dict, max_bytes: int = 1 << 30, max_flops: int = 4 << 30) -> tuple[dict, list]:
    """{str(op index): scratch bytes} for `calls` (from matmul_calls), each distinct call run once; and the calls
    not measured, each with why: operands over `max_bytes` are not allocated, and a call of more than
    `max_flops` (some 0.1 s on one core) is not run, so that a forecast for a large target stays quick."""
    out: dict[str, int] = {}
    skipped: list[str] = []
    done: dict[str, int] = {}
    for i, (name, operands) in calls.items():
        key = json.dumps([name, operands])
        if key not in done:
            dtypes = [_DTYPES[d] for _, _, d in operands]
            size = sum(_nbytes(s, st, d) for (s, st, _), d in zip(operands, dtypes))
            if size > max_bytes:
                skipped.append(f"{name} {[s for s, _, _ in operands]} (operands of {size} bytes at the target batch)")
                done[key] = -1
                continue
            if _flops(operands) > max_flops:
                skipped.append(f"{name} {[s for s, _, _ in operands]} ({_flops(operands)} FLOP at the target batch)")
                done[key] = -1
                continue
            with torch.no_grad():
                xs = [torch.empty_strided(s, st, dtype=d).zero_() for (s, st, _), d in zip(operands, dtypes)]
                fn = getattr(torch.ops.aten, name.split("::", 1)[1]).default
                done[key] = _transient(lambda: fn(*xs), "cpu")
            del xs
        if done[key] >= 0:
            out[str(i)] = done[key]
    return out, skipped


def measure_quietly(ref: Any, prev: Any, ref_batch: int, prev_batch: int, batch: int) -> tuple[dict, list]:
    """measure() of matmul_calls() over two probes' traces (torch.classes.gpucast.Trace); any failure leaves the
    forecast to the probes' scratch."""
    try:
        calls, skipped = matmul_calls(json.loads(ref.ops_json(list(_MATMULS))),
                                      json.loads(prev.ops_json(list(_MATMULS))), ref_batch, prev_batch, batch)
        ws, not_measured = measure(calls)
        return ws, skipped + not_measured
    except Exception as e:  # the forecast must not fail for this
        return {}, [f"every call ({type(e).__name__}: {e})"]
