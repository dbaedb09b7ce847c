"""A forecast step as a Chrome/Perfetto trace (Forecast.save_timeline): per pipeline stage a compute stream and a
communication stream, from the spans and collectives the C++ step-time forecast lays out."""
from __future__ import annotations

import json


def write_timeline(tm, path: str) -> None:
    """Write `tm` (a TimeForecast) to `path` as a Chrome trace; where the graph network corrected the step, the drawn
    schedule is the uncorrected one and a mark shows where the corrected step ends."""

    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "gpucast forecast step"}}]
    for s in range(tm.pp):
        prefix = f"stage {s} " if tm.pp > 1 else ""
        events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": 2 * s, "args": {"name": prefix + "compute"}},
                   {"name": "thread_name", "ph": "M", "pid": 0, "tid": 2 * s + 1,
                    "args": {"name": prefix + "communication"}}]

    def add(name, start_ms, dur_ms, tid, cat, **args):
        events.append({"name": name, "cat": cat, "ph": "X", "pid": 0, "tid": tid, "ts": start_ms * 1e3,
                       "dur": max(dur_ms, 0.0) * 1e3, "args": args})
    for c in tm.compute:
        add(c["name"], c["start_ms"], c["end_ms"] - c["start_ms"], 2 * c["stage"], c["kind"],
            micro_batch=c["micro_batch"])
    for c in tm.comm:
        add(f"{c['kind']} ({c['bytes'] / 2**20:.2f} MiB)", c["start_ms"], c["end_ms"] - c["start_ms"],
            2 * c.get("stage", 0) + 1, "communication", bytes=c["bytes"])
    if tm.alpha != 1.0 or tm.beta != 1.0:
        events.append({"name": f"forecast step end (graph network: alpha {tm.alpha:.3f}, beta {tm.beta:.3f}; "
                               f"uncorrected {tm.uncorrected_step_ms:.3f} ms)", "ph": "i", "s": "p", "pid": 0,
                       "tid": 0, "ts": tm.step_ms * 1e3})
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
