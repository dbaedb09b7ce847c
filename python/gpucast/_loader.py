"""Finding and loading the gpucast plugin library."""
from __future__ import annotations

import os
from pathlib import Path

import torch

_LIB_NAME = "libgpucast.so"
_loaded: str | None = None


def library_path() -> str:
    """Where the plugin library is: $GPUCAST_LIBRARY, next to this package, or a source tree's build/."""
    env = os.environ.get("GPUCAST_LIBRARY")
    if env:
        if not Path(env).is_file():
            raise FileNotFoundError(f"GPUCAST_LIBRARY={env!r}: no such file; point it at {_LIB_NAME} or unset it")
        return env
    here = Path(__file__).resolve().parent
    candidates = [here / "lib" / _LIB_NAME, here.parent.parent / "build" / "lib" / _LIB_NAME]
    for c in candidates:
        if c.is_file():
            return str(c)
    raise FileNotFoundError(
        f"gpucast: {_LIB_NAME} not found (looked in {', '.join(str(c) for c in candidates)}); "
        "build it with `make build` or set GPUCAST_LIBRARY")


def check_torch(built_with: str | None, running: str) -> None:
    """An installed gpucast works only with the torch it was built against: say so before the loader fails."""
    if built_with is None:
        return
    base = running.split("+")[0]
    if built_with.split("+")[0] != base:
        raise ImportError(
            f"gpucast was built against torch {built_with}, but this is torch {running}; rebuild it against this "
            "torch: pip install --no-build-isolation --force-reinstall --no-deps <gpucast source>")


def load() -> str:
    """Load the plugin once (torch.ops.load_library); return its path."""
    global _loaded
    if _loaded is None:
        try:
            from ._build_info import torch_version as built_with
        except ImportError:  # a source tree: built by `make`, against the venv's torch
            built_with = None
        check_torch(built_with, torch.__version__)
        path = library_path()
        torch.ops.load_library(path)
        _loaded = path
    return _loaded
