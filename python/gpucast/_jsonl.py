"""JSON Lines files gpucast appends to (GPUCAST_LOG, gpucast.log_to, the resumable dataset writer): one
implementation of appending and reading, safe against a torn last line.

Appending starts on a new line: a file whose last line was cut short (a killed process, a full disk) gets a newline
first, so the new record is never glued onto it. Reading skips a line that is not complete JSON and says so once. Only regular files are appended to, opened without blocking: a FIFO or device given as a log path is refused
instead of stalling the training thread."""
from __future__ import annotations

import json
import os
import stat
import warnings
from typing import Any, Iterator


def append_record(path: str, record: dict) -> None:
    """Append `record` as one line to `path` (created if missing). OSError names the path and the reason."""
    line = (json.dumps(record) + "\n").encode("utf-8")
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"cannot append to '{path}': not a regular file (gpucast writes logs to regular files only)")
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size > 0 and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line  # the last line was torn: start on a new one
        os.write(fd, line)
    finally:
        os.close(fd)


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
        warnings.warn(f"{path}: skipped {len(torn)} line(s) that are not complete JSON records (torn writes): "
                      f"line {', '.join(map(str, torn[:10]))}{' ...' if len(torn) > 10 else ''}", stacklevel=2)
