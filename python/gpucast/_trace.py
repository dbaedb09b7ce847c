"""gpucast.trace(): record training iterations at the dispatcher.

The recording is done in C++ (torch.ops.gpucast.*). This module only adds what Python sees better:
module paths (global module forward hooks), and which blocks are parameters, gradients, optimizer
state and inputs (module and optimizer hooks), handed to C++ as tags.
"""
from __future__ import annotations

import ctypes
import json
import threading
from types import SimpleNamespace
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Iterable

import torch
import torch.optim.optimizer as _optimizer_module

_ops = torch.ops.gpucast
# True while TorchDynamo traces a function (torch.compile): the global hooks below then do nothing, so that the
# compiled graph holds none of their bookkeeping (Dynamo cannot trace it, and the compile would fail); the ops of
# a compiled region are recorded under the module that called it.
compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)

# Recorded after each call of the training step inside gpucast.forecast's traces: the trace's iterations end there
# (profiler/include/gpucast/trace.h: iteration_ends), whatever optimizers the step runs and in whatever order.
ITERATION_END = "gpucast.iteration_end"


def mark_iteration_end() -> None:
    """Inside a trace: an iteration of the training step ended here (the user scope ITERATION_END)."""
    with torch.profiler.record_function(ITERATION_END):
        pass


def _format_value(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_format_value(key, v) for v in value) + "]"
    return str(value)


def _flag(options: dict[str, Any], key: str) -> bool:
    """A boolean option as the C++ parser reads it (True / False, or their text); absent: on."""
    return _format_value(key, options.get(key, True)) not in ("False", "false", "0")


def _format_options(options: dict[str, Any]) -> str:
    return ",".join(f"{k}:{_format_value(k, v)}" for k, v in options.items())


def trace_options() -> str:
    """The options gpucast.trace() accepts, with their forms, defaults and meaning."""
    return _ops.trace_options_help()


def _tag(tensors: Iterable[Any], category: str) -> None:
    ts = [t for t in tensors if isinstance(t, torch.Tensor)]
    if ts:
        _ops.tag_tensors(ts, category)


def _flatten(obj: Any, out: list) -> list:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _flatten(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _flatten(o, out)
    return out


_MODULE_CALLS: tuple | None = None


def _module_calls(use_c: bool = True) -> tuple:
    """(module_code, push_module_code, pop_module): the module hooks' calls into the running trace. The library's
    C entry points through ctypes (PyDLL: the GIL stays held, the calls touch no Python object), about a third of
    a dispatcher call's cost, which the hooks pay around every module call; the dispatcher ops where the library's
    symbols cannot be reached (use_c False: the same)."""
    global _MODULE_CALLS
    if not use_c:
        return _ops.module_code, _ops.push_module_code, _ops.pop_module
    if _MODULE_CALLS is None:
        try:
            from ._loader import load
            lib = ctypes.PyDLL(load())
            code, push, pop = lib.gpucast_module_code, lib.gpucast_push_module_code, lib.gpucast_pop_module
            code.argtypes, code.restype = [ctypes.c_char_p], ctypes.c_int64
            push.argtypes, push.restype = [ctypes.c_int64], None
            pop.argtypes, pop.restype = [], None
            _MODULE_CALLS = (lambda path: code(path.encode()), push, pop)
        except (OSError, AttributeError):
            _MODULE_CALLS = _module_calls(use_c=False)
    return _MODULE_CALLS


class _Hooks:
    """Global module and optimizer hooks installed for the duration of one trace."""

    def __init__(self, module_paths: bool, tags: bool = True, model: torch.nn.Module | None = None):
        self._local = threading.local()
        self._tags = tags  # tags categorize memory events: without them (memory off), no tagging at all
        self._paths: dict[int, dict[int, str]] = {}  # root module id -> {module id: path} of its modules
        self._roots: dict[int, tuple[str, dict[int, str]]] = {}  # a module called outermost: its path, its root's paths
        self._root_names: dict[str, int] = {}  # root name -> the root module's id (two roots of a class: "X#2")
        if model is not None:
            self._paths[id(model)] = self._named(model, type(model).__name__)
            self._root_names[type(model).__name__] = id(model)
        self._seen: dict[int, torch.nn.Module] = {}
        self._optimizers: dict[int, torch.optim.Optimizer] = {}
        self._handles: list = []
        self._module_paths = module_paths
        self._code, self._push, self._pop = _module_calls()
        self._codes: dict[str, int] = {}  # module path -> its code in this trace

    def _stack(self) -> list:
        st = getattr(self._local, "stack", None)
        if st is None:
            st = self._local.stack = []
        return st

    @staticmethod
    def _named(root: torch.nn.Module, name: str) -> dict[int, str]:
        return {id(m): (f"{name}.{n}" if n else name) for n, m in root.named_modules()}

    def _outermost(self, module: torch.nn.Module) -> tuple[str, dict[int, str]]:
        """A module called outside any other: its path in the model (trace's model=) or in a root called before,
        else a root of its own, named by its class ("Sequential", then "Sequential#2" for another of the class)."""
        for paths in self._paths.values():
            path = paths.get(id(module))
            if path is not None:
                return path, paths
        name = base = type(module).__name__
        n = 1
        while self._root_names.get(name, id(module)) != id(module):
            n += 1
            name = f"{base}#{n}"
        self._root_names[name] = id(module)
        paths = self._paths[id(module)] = self._named(module, name)
        return name, paths

    def _path_of(self, module: torch.nn.Module) -> str:
        """Module path: the root's class name, then the names of named_modules() ("GPT.blocks.0.mlp")."""
        st = self._stack()
        if not st:
            found = self._roots.get(id(module))
            if found is None:
                found = self._roots[id(module)] = self._outermost(module)
            self._local.root_paths = found[1]
            return found[0]
        path = getattr(self._local, "root_paths", {}).get(id(module))
        if path is None:  # not a submodule of the outermost module: nest under the caller
            path = f"{st[-1][1]}.{type(module).__name__}"
        return path

    def pre(self, module: torch.nn.Module, args: Any) -> None:
        if compiling():
            return
        st = self._stack()
        if st and st[0][0] is module:
            # The outermost module called again while its entries are still open: an exception left its last
            # forward (the post hooks run on a normal return only).
            self._unwind(st, 0)
        if not st and self._tags:
            _tag(_flatten(args, []), "input")
        path = self._path_of(module)
        code = -1
        if self._module_paths:
            code = self._codes.get(path, -2)
            if code == -2:
                code = self._codes[path] = self._code(path)
            if code >= 0:
                self._push(code)
        st.append((module, path, code))
        if self._tags and id(module) not in self._seen:
            self._seen[id(module)] = module
            _tag(module._parameters.values(), "parameter")

    def _unwind(self, st: list, i: int) -> None:
        """Close the entries from position i up (in the trace too while it runs)."""
        while len(st) > i:
            if st.pop()[2] >= 0 and self._module_paths:
                self._pop()

    def close(self) -> None:
        """The trace has stopped: hooks left installed (inert) push and pop nothing in later traces, whose
        module codes differ."""
        self._module_paths = False

    def post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if compiling():
            return
        st = self._stack()
        for i in range(len(st) - 1, -1, -1):
            if st[i][0] is module:  # above it: modules an exception left, caught inside this one's forward
                self._unwind(st, i)
                return

    def optimizer_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if compiling():
            return
        self._optimizers[id(optimizer)] = optimizer
        params = [p for g in optimizer.param_groups for p in g["params"]]
        _tag(params, "parameter")
        _tag([p.grad for p in params if p.grad is not None], "gradient")

    def optimizer_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if compiling():
            return
        states = []
        for s in optimizer.state.values():
            _flatten(s, states)
        _tag(states, "optimizer_state")

    def install(self) -> None:
        m = torch.nn.modules.module
        self._handles = [
            m.register_module_forward_pre_hook(self.pre),
            # Not always_call: the post hook then costs a tenth as much; an exception's open entries are closed
            # by the next post hook of an enclosing module, or the next call of the outermost one (pre).
            m.register_module_forward_hook(self.post),
        ]
        if self._tags:  # these hooks run inside the optimizer step's record: only where they are needed
            self._handles += [
                _optimizer_module.register_optimizer_step_pre_hook(self.optimizer_pre),
                _optimizer_module.register_optimizer_step_post_hook(self.optimizer_post),
            ]

    def tag_final(self) -> None:
        """Tag what is held at the end: parameters, gradients, optimizer state."""
        if not self._tags:
            return
        params = [p for m in self._seen.values() for p in m._parameters.values() if p is not None]
        _tag(params, "parameter")
        _tag([p.grad for p in params if p.grad is not None], "gradient")
        for opt in self._optimizers.values():
            self.optimizer_post(opt, (), {})

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._stack().clear()


def _value(d: dict) -> SimpleNamespace:
    v = SimpleNamespace(**d)
    if d["kind"] == "tensor_list":
        v.tensors = [SimpleNamespace(**t) for t in d["tensors"]]
    return v


def _op(d: dict) -> SimpleNamespace:
    d = dict(d)
    d["inputs"] = [_value(v) for v in d["inputs"]]
    d["outputs"] = [_value(v) for v in d["outputs"]]
    return SimpleNamespace(**d)


class _Records(Sequence):
    """A trace's ops, events or allocations as a read-only sequence whose records are built from C++ a chunk at a
    time: iterating a trace at the op cap holds one chunk in Python, not the whole trace."""

    _CHUNK = 4096  # records per call: about 50 MB of Python objects for ops with inputs, at most

    def __init__(self, handle: Any, kind: str, size: int, make: Callable[[dict], Any]):
        self._h, self._kind, self._size, self._make = handle, kind, size, make

    def __len__(self) -> int:
        return self._size

    def _chunk(self, first: int, count: int) -> list:
        return [self._make(d) for d in json.loads(self._h.records_json(self._kind, first, count))]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self._size))]
        if i < 0:
            i += self._size
        if not 0 <= i < self._size:
            raise IndexError(f"trace {self._kind}: index {i} out of range ({self._size})")
        return self._chunk(i, 1)[0]

    def __iter__(self) -> Iterator:
        for first in range(0, self._size, self._CHUNK):
            yield from self._chunk(first, self._CHUNK)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, _Records)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"<trace {self._kind}: {self._size} records>"


class Trace:
    """A recorded trace. Backed by the C++ value; Python's views of it are lazy (ops, events, allocations are read
    a chunk at a time) or computed in C++ (summary, peak and category bytes), so their memory stays bounded."""

    def __init__(self, handle: Any):
        self._h = handle
        self._header: dict | None = None

    def _head(self) -> dict:
        if self._header is None:
            self._header = json.loads(self._h.header_json())
        return self._header

    @property
    def ops(self) -> Sequence:
        """Op records: name, overload, scope, phase, module, inputs, outputs, start_ns, end_ns, ..."""
        return _Records(self._h, "ops", self._h.num_ops(), _op)

    @property
    def events(self) -> Sequence:
        """Memory events in order: ptr, bytes (+alloc/-free), block_bytes, device, op, phase, ..."""
        return _Records(self._h, "events", self._h.num_events(), lambda e: SimpleNamespace(**e))

    @property
    def allocations(self) -> Sequence:
        """Blocks seen in the window: ptr, bytes, device, baseline, alloc/free event and op, category."""
        return _Records(self._h, "allocations", self._h.num_allocations(), lambda a: SimpleNamespace(**a))

    @property
    def counters(self) -> dict:
        return dict(self._head()["counters"])

    @property
    def notes(self) -> list[dict]:
        """What the trace noted while recording (backends unavailable, fallbacks taken), each {"code", "text"}
        (codes: docs/design.md)."""
        return [dict(n) for n in self._head()["notes"]]

    @property
    def context(self) -> dict:
        return dict(self._head()["context"])

    def summary(self, top: int = 5) -> str:
        return self._h.summary(top)

    def peak_bytes(self, device: str = "cpu") -> int:
        """Window peak: most bytes held at once on `device`, counted from the trace's start."""
        return self._h.peak_bytes(str(device))

    def baseline_bytes(self, device: str = "cpu") -> int:
        """Bytes held on `device` when the trace started, as far as the allocator could tell."""
        return self._h.baseline_bytes(str(device))

    def bytes_by_category(self, device: str = "cpu", at: str = "end") -> dict[str, int]:
        """Bytes held by category at the end of the trace (at="end") or at the window peak (at="peak")."""
        if at not in ("end", "peak"):
            raise ValueError(f"bytes_by_category: 'at' must be 'end' or 'peak', got {at!r}")
        return json.loads(self._h.bytes_by_category(str(device), at == "peak"))

    def save(self, path: str) -> None:
        """Write the trace as JSON (schema_version and context included); load it with gpucast.load_trace."""
        self._h.save(str(path))

    def save_chrome(self, path: str) -> None:
        """Write a Chrome trace event file that opens in Perfetto (ui.perfetto.dev) or chrome://tracing."""
        self._h.save_chrome(str(path))

    def to_json(self) -> str:
        return self._h.to_json()

    def save_memory_png(self, path: str, device: str = "cpu", **lines: Any) -> None:
        """Memory timeline stacked by category (forecast_peak=, measured_peak=, capacity= draw lines)."""
        from ._pictures import save_memory_png
        save_memory_png(self, path, device, **lines)

    def save_html(self, path: str, device: str = "cpu", **lines: Any) -> None:
        """Self-contained HTML report: summary and memory timeline."""
        from ._pictures import save_html_report
        save_html_report(self, path, device, **lines)

    def save_memory_snapshot(self, path: str) -> None:
        """PyTorch's memory-snapshot format (pickle): opens in PyTorch's memory_viz."""
        from ._pictures import save_memory_snapshot
        save_memory_snapshot(self, path)

    def memory_snapshot(self) -> dict:
        from ._pictures import memory_snapshot
        return memory_snapshot(self)

    @property
    def handle(self) -> Any:
        """The torch.classes.gpucast.Trace underneath, for torch.ops.gpucast.* calls."""
        return self._h

    def __len__(self) -> int:
        return self._h.num_ops()

    def __repr__(self) -> str:
        return f"<gpucast.Trace: {self._h.num_ops()} ops, {self._h.num_events()} memory events>"


def load_trace(path: str) -> Trace:
    """Load a trace saved with Trace.save(); errors name the path and what is wrong."""
    return Trace(_ops.load_trace(str(path)))


class trace:
    """Record what runs inside the block: ``with gpucast.trace() as t: step(batch)``.

    Options (see gpucast.trace_options()): record_shapes, memory, module_paths, max_ops, max_events.
    timed_layers: sparse timing, a list of layers (module paths as the trace names them, e.g. "GPT.blocks.0.mlp.0",
    or "(outside modules)"): device timers (CUPTI, CUDA events) are taken only around their ops, their backward
    and the optimizer step, and the step-time forecast uses only their times (CPU clocks time every op); None:
    every layer. model: the training's model; modules called outside any other module (a GAN's generator, then
    its discriminator) are named by their path in it ("ModuleDict.G.0"); without it, by their path in a module
    called before, else as roots of their own, by class ("Sequential", then "Sequential#2" for another).
    After the block, ``t`` gives the recorded Trace's views: t.ops, t.allocations, t.summary(), ...
    """

    def __init__(self, timed_layers: Sequence[str] | None = None, model: torch.nn.Module | None = None,
                 **options: Any):
        if timed_layers is not None and (isinstance(timed_layers, str) or
                                         not all(isinstance(x, str) for x in timed_layers)):
            raise ValueError(f"gpucast.trace: timed_layers should be a list of layer names (str), got "
                             f"{timed_layers!r}")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ValueError(f"gpucast.trace: model should be a torch.nn.Module, got {type(model).__name__}")
        self._model = model
        self._timed_layers = list(timed_layers or [])
        self._options = _format_options(options)
        _ops.check_trace_options(self._options)  # ValueError naming the option, before anything runs
        self._module_paths = _flag(options, "module_paths")
        self._memory = _flag(options, "memory")
        self._hooks: _Hooks | None = None
        self._trace: Trace | None = None

    def __enter__(self) -> "trace":
        self._hooks = _Hooks(self._module_paths, tags=self._memory, model=self._model)
        self._hooks.install()
        options = self._options
        if "autograd_tags" not in options:  # the hooks tag parameters, gradients, optimizer state and inputs
            options = ",".join(o for o in (options, "autograd_tags:False") if o)
        if torch.autograd.profiler._is_profiler_enabled and "external_profiler" not in options:
            # torch.profiler may hold CUPTI: gpucast then times device work with CUDA events.
            options = ",".join(o for o in (options, "external_profiler:True") if o)
        try:
            _ops.start_trace(options, self._timed_layers)
        except BaseException:
            self._hooks.remove()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._finish(unhook=True)
        return False

    def _finish(self, unhook: bool) -> None:
        """Stop recording. unhook=False leaves the (now inert) Python hooks installed, for callers running
        inside an optimizer hook, whose registry may not change while PyTorch iterates over it."""
        try:
            self._hooks.tag_final()
        finally:
            self._hooks.close()
            if unhook:
                self._hooks.remove()
            self._trace = Trace(_ops.stop_trace())

    @property
    def result(self) -> Trace:
        if self._trace is None:
            raise RuntimeError("gpucast.trace: the trace is still running; use its results after the with-block")
        return self._trace

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.result, name)
