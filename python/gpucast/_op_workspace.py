"""The scratch of each matrix multiply at the target batch, measured on the CPU.

On the CPU, oneDNN and PyTorch's other CPU kernels run some matrix multiplies with a scratchpad taken from PyTorch's
allocator inside the call, sized by their blocking of the problem, not in proportion to the batch, so probes at small
batches cannot show it. For a CPU target from CPU probes, gpucast.forecast runs each matrix-multiply call of the
largest probe alone at the target batch, its shapes extrapolated from the two largest probes, and the forecast models
those scratches instead of the probes'. The rules live in C++ (predictor/include/gpucast/workspace_calls.h,
plugin/ops_workspace.cpp); this adapter keeps a failure from failing the forecast."""
from __future__ import annotations

from typing import Any

import torch


def measure_quietly(ref: Any, prev: Any, ref_batch: int, prev_batch: int, batch: int) -> tuple[dict, list]:
    """{str(op index in ref): scratch bytes} for the matrix multiplies of the largest probe `ref` at `batch`, from it
    and the probe before it (torch.classes.gpucast.Trace), and the calls left out, each with why; any failure leaves
    the forecast to the probes' scratch."""
    try:
        ws, skipped = torch.ops.gpucast.measure_matmul_workspaces(ref, prev, ref_batch, prev_batch, batch)
        return dict(ws), list(skipped)
    except Exception as e:  # the forecast must not fail for this
        return {}, [f"every call ({type(e).__name__}: {e})"]
