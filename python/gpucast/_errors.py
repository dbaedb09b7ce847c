"""The kinds of gpucast's errors: a C++ error that a caller may act on starts with a stable code, "[gpucast:<code>] "
(common/include/gpucast/error.h); Python branches on the code, never on the message's prose. docs/design.md lists
the codes."""
from __future__ import annotations

import re

_CODE = re.compile(r"\[gpucast:([a-z0-9]+(?:-[a-z0-9]+)*)\] ")


def error_code(e: BaseException) -> str | None:
    """The code at the start of the error's message, or None where it has none."""
    m = _CODE.match(str(e))
    return m.group(1) if m else None
