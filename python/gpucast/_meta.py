"""Probes on the meta device: the kernels PyTorch runs there otherwise than on the CPU, run as the CPU runs them while
the probes last (the substitutions docs/design.md lists under "The meta device"). The meta trace itself is folded in
C++ (profiler/trace_assembly.cpp, fold_meta_kernels): Python meta kernels recorded as the one kernel the CPU runs."""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Iterator

import torch

# The backend numbers _fused_sdp_choice returns (aten/src/ATen/native/transformers/sdp_utils_cpp.h, SDPBackend).
_FLASH = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION.value)


def _shape_kind(t: torch.Tensor | None, ref: tuple, mask: bool = False) -> tuple | None:
    """What the CPU's attention backend choice reads of a tensor (aten/src/ATen/native/transformers/
    sdp_utils_cpp.cpp, use_flash_attention_cpp and the checks it calls): its dimensions, the heads (dim -3) and the
    head dimension (the last, but in a mask) as they are, whether each other size is zero or equals `ref`'s (the
    query's shape; for a mask, the attention weights' (batch, heads, query length, key length), where a size of 1
    broadcasts), the last dimension's stride, the dtype and whether it requires grad. The other sizes become 1
    (equal, or a mask's broadcast), 2 (not) or 0: no constraint reads more of them, so one answer serves every
    probe, whatever its batch and length."""
    if t is None:
        return None
    n, rn = t.dim(), len(ref)
    keep = {n - 3} if mask else {n - 3, n - 1}
    shape = []
    for i, s in enumerate(t.shape):
        j = rn - (n - i)  # ref's dimension aligned with this one
        if i in keep or s == 0:
            shape.append(s)
        elif (mask and s == 1) or (0 <= j < rn and s == ref[j]):
            shape.append(1)
        else:
            shape.append(2)
    return (tuple(shape), t.dtype, t.stride(-1) == 1 if n else True, bool(t.requires_grad))


def _host_like(kind: tuple | None) -> torch.Tensor | None:
    """A CPU tensor of that kind, holding its last dimension only (strides 0 before it)."""
    if kind is None:
        return None
    shape, dtype, unit_stride, grad = kind
    if not shape:
        return torch.empty((), dtype=dtype).requires_grad_(grad) if grad else torch.empty((), dtype=dtype)
    last = shape[-1] if unit_stride else 2 * shape[-1]
    base = torch.empty(last, dtype=dtype)
    strides = [0] * (len(shape) - 1) + [1 if unit_stride else 2]
    view = base.as_strided(shape, strides)
    return view.requires_grad_(grad) if grad else view


@functools.lru_cache(maxsize=256)
def _cpu_choice(q: tuple, k: tuple, v: tuple, mask: tuple | None, dropout: bool, causal: bool, gqa: bool,
                flash_on: bool, math_on: bool) -> int:
    """The backend the CPU picks for such arguments, asked of the CPU (the flags are part of the key: they
    change the answer). The probes' warm-up asks first, untraced: the probes then find the answer here."""
    del flash_on, math_on
    return int(torch._fused_sdp_choice(_host_like(q), _host_like(k), _host_like(v), _host_like(mask),
                                       0.5 if dropout else 0.0, causal, enable_gqa=gqa))


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as the CPU's attention takes it, additive (aten/src/ATen/native/transformers/attention.cpp,
    convert_boolean_attn_mask); other masks as they are."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), float("-inf"), torch.scalar_tensor(0.0, dtype=dtype, device=mask.device))


def _attention_as_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                      dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
                      enable_gqa: bool = False) -> torch.Tensor:
    """aten::scaled_dot_product_attention for meta tensors, registered at AutogradMeta while meta probes run (so that
    it holds in backward's recomputations too). PyTorch's composite asks a backend only of devices with a choice
    (attention.cpp, scaled_dot_product_attention: _fused_sdp_choice_stub's is_device_supported), so on meta it
    always runs the math path, which saves the whole sequence x sequence matrix where the CPU's flash kernel (and
    the GPU's) saves a logsumexp. This runs the branch the CPU picks, as attention.cpp runs it: the mask made
    additive (convert_boolean_attn_mask), then _scaled_dot_product_flash_attention_for_cpu or
    _scaled_dot_product_attention_math, each differentiable on its own."""
    ctx = torch.backends.cuda
    q = tuple(query.shape)
    weights = q[:-1] + (key.shape[-2],) if key.dim() >= 2 else q
    choice = _cpu_choice(_shape_kind(query, q), _shape_kind(key, q), _shape_kind(value, q),
                         _shape_kind(attn_mask, weights, mask=True),
                         dropout_p > 0.0, bool(is_causal), bool(enable_gqa), ctx.flash_sdp_enabled(),
                         ctx.math_sdp_enabled())
    mask = _additive_mask(attn_mask, query.dtype)
    if choice == _FLASH:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=mask, scale=scale)[0]
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]


@functools.lru_cache(maxsize=1)
def _composite_ops() -> tuple:
    """The ATen operators meta runs as the CompositeExplicitAutograd kernel the CPU and CUDA run, where PyTorch's
    Python meta kernel would stand in for it with other ops (C++: profiler/meta_kernels.cpp, the one rule the
    trace's fold reads too): aten::_safe_softmax, aten::embedding, aten::mul.Scalar..."""
    return tuple(n for n in torch._C._dispatch_get_all_op_names()
                 if n.startswith("aten::") and torch.ops.gpucast.meta_runs_composite(n))


def _python_meta(op: torch._ops.OpOverload):
    """The Python meta kernel PyTorch registered for `op` (torch/_meta_registrations.py activate_meta's choice:
    a meta function, else a decomposition), None if none."""
    from torch._decomp import global_decomposition_table
    for kind in ("meta", "post_autograd", "pre_autograd"):
        fn = global_decomposition_table[kind].get(op)
        if fn is not None:
            return fn
    return None


# The scope around PyTorch's Python meta kernel where a composite could not run on meta (kMetaFallbackScope in
# profiler/meta_kernels.cpp).
FALLBACK_SCOPE = "gpucast.meta_fallback"


def _composite_kernel(op: torch._ops.OpOverload):
    """A meta kernel running `op`'s CompositeExplicitAutograd kernel; where that fails on meta (a composite that
    picks a kernel by device), PyTorch's Python meta kernel as before."""
    fallback = _python_meta(op)

    def kernel(*args, **kwargs):
        try:
            return op._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, *args, **kwargs)
        except (NotImplementedError, RuntimeError):
            if fallback is None:
                raise
            # The trace folds this scope as it folds a Python meta kernel (profiler/meta_kernels.cpp).
            with torch.autograd.profiler.record_function(FALLBACK_SCOPE):
                return fallback(*args, **kwargs)
    return kernel


def _overload(name: str) -> torch._ops.OpOverload:
    base, _, overload = name.split("::", 1)[1].partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _contiguous_strides(size: list, memory_format: torch.memory_format | None) -> list:
    """Strides of a tensor of `size` in `memory_format` (channels_last: 4-D, channels_last_3d: 5-D, as
    c10/core/MemoryFormat.h get_channels_last_strides_2d/3d; otherwise row-major)."""
    n = len(size)
    if memory_format == torch.channels_last and n == 4:
        order = [1, 3, 2, 0]  # innermost first: C, W, H, N
    elif memory_format == torch.channels_last_3d and n == 5:
        order = [1, 4, 3, 2, 0]
    else:
        order = list(range(n - 1, -1, -1))
    strides, step = [0] * n, 1
    for d in order:
        strides[d] = step
        step *= max(int(size[d]), 1)
    return strides


def _resize_meta(self: torch.Tensor, size, memory_format=None) -> torch.Tensor:
    """aten::resize_ on meta as the CPU runs it: where the storage is too small, a storage of the bytes needed is
    allocated (through the meta allocator, so the trace sees it) and the old one let go, as resize_bytes_cpu does
    (aten/src/ATen/native/Resize.cpp); c10's meta kernel only sets the storage's byte count (resize_bytes_meta),
    which no allocator sees. The new storage replaces the old in this tensor (a view of the old storage keeps the
    old one: the CPU would have moved it too; no job relies on that)."""
    if memory_format == torch.preserve_format:
        raise RuntimeError("Unsupported memory format Preserve")  # as the CPU's resize_ says
    size = [int(s) for s in size]
    if list(self.shape) == size and memory_format is None:
        return self  # the CPU's resize_ keeps the strides of a tensor already that size
    numel = 1
    for s in size:
        numel *= s
    need = (self.storage_offset() + numel) * self.element_size() if numel else 0
    storage = self.untyped_storage()
    if need > storage.nbytes():
        storage = torch.empty(need, dtype=torch.uint8, device="meta").untyped_storage()
    with torch.no_grad():
        self.set_(storage, self.storage_offset(), size, _contiguous_strides(size, memory_format))
    return self


AUTOCAST = ("forecast: the step enters torch.autocast with a lower precision, which does not cast meta tensors (no "
            "device's autocast applies to them): its memory would come out in float32; a mixed-precision job is not "
            "forecast from meta probes yet: probe it on the CPU (at a smaller size) or on the GPU")


_AUTOCAST_LOCK = __import__("threading").Lock()
_autocast_depth = 0
_autocast_init = torch.amp.autocast_mode.autocast.__init__


def _meta_autocast_init(self, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                        cache_enabled: bool | None = None) -> None:
    """torch.autocast's __init__ while meta probes run (every alias and subclass: torch.cpu.amp.autocast,
    torch.cuda.amp.autocast, a name imported before): disabled, it does what it does anyway on meta tensors
    (nothing), with device_type "meta" taken as the CPU's (transformers' rotary embeddings open
    torch.autocast(device_type=x.device.type, enabled=False) to compute in float32, and "meta" has no autocast
    state: "unsupported scalarType"); enabled, it refuses (AUTOCAST), as casting nothing would give a float32
    forecast of a mixed-precision job."""
    if enabled:
        raise ValueError(AUTOCAST)
    _autocast_init(self, "cpu" if device_type == "meta" else device_type, dtype=dtype, enabled=False,
                   cache_enabled=cache_enabled)


@contextlib.contextmanager
def _autocast_as_meta() -> Iterator[None]:
    """Replaces autocast's __init__ for the outermost of nested (or concurrent) scopes, and puts it back when the
    last one ends."""
    global _autocast_depth
    with _AUTOCAST_LOCK:
        _autocast_depth += 1
        if _autocast_depth == 1:
            torch.amp.autocast_mode.autocast.__init__ = _meta_autocast_init
    try:
        yield
    finally:
        with _AUTOCAST_LOCK:
            _autocast_depth -= 1
            if _autocast_depth == 0:
                torch.amp.autocast_mode.autocast.__init__ = _autocast_init


def refusal(error: BaseException, model: torch.nn.Module | None) -> ValueError:
    """The error a step that cannot run on meta raised, as a ValueError naming the module it ran in (the innermost
    module method on the traceback) and what to do."""
    where = ""
    names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
    tb = error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module):
            path = names.get(id(owner))
            kind = type(owner).__name__
            where = f" (in {kind} {path!r})" if path else f" (in a {kind})"
        tb = tb.tb_next
    if "materialized from meta device" in str(error):
        # torch/distributed/fsdp/_fully_shard/_fsdp_state.py (_lazy_init) refuses parameters left on meta.
        todo = ("fully_shard does not train meta parameters: forecast the model before fully_shard, on meta, with "
                "parallel=dict(dp=N, dp_mode='fsdp', fsdp_units=[the modules you shard]) (FSDP2's rule)")
    else:
        todo = ("if it fails for want of values (.item(), nonzero, boolean-mask indexing, routing to experts: an "
                "output whose shape depends on the data), probe on the CPU at a smaller size, or on the GPU")
    return ValueError(f"forecast: the step cannot run on the meta device{where}: {type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''}; {todo}")


@contextlib.contextmanager
def probe_scope() -> Iterator[None]:
    """While meta probes run, meta ops run the kernels the CPU would: attention through the CPU's backend choice, the
    composites the CPU and CUDA run (_composite_ops), resize_ through the meta allocator, and
    torch.autocast as _meta_autocast_init says. The kernels are registered for the process, over PyTorch's Python
    ones, and taken back at the end (another thread running meta ops meanwhile sees them); torch.autocast is the
    process's too."""
    # Library._destroy forgets the keys it registered in torch.library's registry (torch/library.py _impls), which
    # PyTorch's own meta registrations hold too: those are put back.
    held = set(torch.library._impls)
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # each registration warns that it overrides PyTorch's meta kernel
            for name in _composite_ops():
                op = _overload(name)
                lib.impl(op, _composite_kernel(op), "Meta")
            lib.impl(torch.ops.aten.resize_.default, _resize_meta, "Meta")
            lib.impl(torch.ops.aten.scaled_dot_product_attention.default, _attention_as_cpu, "AutogradMeta")
        with _autocast_as_meta():
            yield
    finally:
        lib._destroy()
        torch.library._impls.update(held)
