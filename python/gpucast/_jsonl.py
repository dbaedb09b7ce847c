"""JSON Lines files gpucast appends to (GPUCAST_LOG, gpucast.log_to, the resumable dataset writer): one
implementation of appending and reading, safe against a torn last line.

Appending starts on a new line: a file whose last line was cut short (a killed process, a full disk) gets a newline
first, so the new record is never glued onto it. Reading skips a line that is not complete JSON and says so once. Only regular files are appended to, opened without blocking: a FIFO or device given as a log path is refused
instead of stalling the training thread."""
from __future__ import annotations

import json
from typing import Any, Iterator

import torch

from ._warnings import warn


def append_record(path: str, record: dict) -> None:
    """Append `record` as one line to `path` (created if missing), through the plugin's one implementation
    (common/files.h: append_line). OSError names the path and the reason."""
    try:
        torch.ops.gpucast.append_line(str(path), json.dumps(record))
    except ValueError as e:
        raise OSError(str(e)) from None


def read_records(path: str, opener: Any = open) -> Iterator[dict]:
    """The records of a JSON Lines file. A line that is not complete JSON (a write cut short, then a newline that
    append_record put after it) is skipped, and the skipped lines are named in one warning at the end."""
    torn = []
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for number, text in enumerate(f, 1):
            text = text.strip()
            if not text:
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError:
                torn.append(number)
                continue
            if isinstance(record, dict):
                yield record
            else:
                torn.append(number)
    if torn:
        warn(f"{path}: skipped {len(torn)} line(s) that are not complete JSON records (torn writes): "
                      f"line {', '.join(map(str, torn[:10]))}{' ...' if len(torn) > 10 else ''}")
