"""gpucast's warnings name the user's line: the first frame outside gpucast, torch and the training frameworks that
call gpucast's callbacks (Lightning, Hugging Face), whatever depth inside gpucast they are raised from."""
from __future__ import annotations

import sys
import warnings

# Top-level packages whose frames are not the user's code.
_NOT_USER = frozenset({"gpucast", "torch", "lightning", "pytorch_lightning", "lightning_fabric", "transformers",
                       "accelerate"})


def _is_user(frame) -> bool:
    return str(frame.f_globals.get("__name__", "")).split(".")[0] not in _NOT_USER


def user_stacklevel() -> int:
    """warnings.warn's stacklevel, for a call in the function that calls this one, naming the first user frame
    above it (the outermost frame when every frame is gpucast's or a framework's)."""
    frame, level = sys._getframe(2), 2  # the caller's caller: stacklevel 2 of a warnings.warn in the caller
    while frame.f_back is not None and not _is_user(frame):
        frame, level = frame.f_back, level + 1
    return level


def warn(text: str, category: type[Warning] = UserWarning) -> None:
    """warnings.warn(text, category) attributed to the user's line."""
    warnings.warn(text, category, stacklevel=user_stacklevel())
