"""The kinds of gpucast's errors: a C++ error that a caller may act on starts with a stable code, "[gpucast:<code>] "
(common/include/gpucast/error.h); Python branches on the code, never on the message's prose. docs/design.md lists
the codes. And the one message for an optional package that is not installed."""
from __future__ import annotations

import importlib
import re
from typing import Any

_CODE = re.compile(r"\[gpucast:([a-z0-9]+(?:-[a-z0-9]+)*)\] ")


def error_code(e: BaseException) -> str | None:
    """The code at the start of the error's message, or None where it has none."""
    m = _CODE.match(str(e))
    return m.group(1) if m else None


def optional_import(module: str, what: str) -> Any:
    """`module`, imported; where its package is not installed, ImportError in one line naming what needs it and the
    pip command ("logging to MLflow needs mlflow: pip install mlflow"), with `name` the package."""
    package = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != package:
            raise
        raise ImportError(f"{what} needs {package}: pip install {package}", name=package) from None
