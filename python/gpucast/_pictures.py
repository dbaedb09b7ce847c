"""Pictures of a trace: the memory timeline of an iteration (PNG, matplotlib), a self-contained HTML report,
and PyTorch's memory-snapshot format for torch.cuda._memory_viz. The numbers come from C++."""
from __future__ import annotations

import base64
import html
import io
import json
import pickle
from typing import Any

from ._errors import optional_import

COLORS = {"parameter": "#4C72B0", "gradient": "#DD8452", "optimizer_state": "#55A868", "activation": "#C44E52",
          "temporary": "#8172B3", "input": "#937860", "other": "#8C8C8C"}
MIB = 2**20
LABEL_SPAN = 0.06  # a phase's name is written where its span is at least this fraction of the window


def memory_series(trace: Any, device: str = "cpu") -> dict:
    """Bytes held by category after each memory event of `device`, baseline included."""
    return json.loads(trace.handle.memory_series(device))


def require_matplotlib(what: str):
    """matplotlib's Figure (no pyplot: no global state, no display needed); where matplotlib is not installed,
    ImportError in one line naming `what` needs it."""
    return optional_import("matplotlib.figure", what).Figure


def phase_starts(trace: Any) -> list[tuple[str, int]]:
    """(phase, start_ns) where each run of top-level ops of one phase (forward, backward, optimizer) begins, on the
    training step's threads: the one that ran the first op and those that ran backward ops (an op on another
    thread, outside backward and the optimizer, counts as forward: it would break a phase in two)."""
    top = [(op.thread, op.phase, op.start_ns) for op in trace.ops if op.depth == 0]
    threads = {th for th, phase, _ in top[:1]} | {th for th, phase, _ in top if phase == "backward"}
    runs: list[tuple[str, int]] = []
    for th, phase, ns in top:
        if th in threads and (not runs or runs[-1][0] != phase):
            runs.append((phase, ns))
    return runs


def _line_labels(**lines: Any) -> list[tuple[str, int, str, str]]:
    """(gid, bytes, label, style) of each horizontal line given: forecast peak, measured peak, capacity."""
    known = (("forecast_peak", "forecast", "forecast peak", "--"), ("measured_peak", "measured", "measured peak", ":"),
             ("capacity", "capacity", "capacity", "-"))
    return [(gid, lines[k], f"{label} {lines[k] / MIB:,.1f} MiB", style) for k, gid, label, style in known if lines.get(k)]


def _mark_phases(ax, trace: Any, t0: int, t1: int) -> None:
    """A dotted vertical line where each phase begins after the first; each phase's name centred at the top of its
    span, where the span is wide enough for it (LABEL_SPAN of the window)."""
    runs = phase_starts(trace)
    ends = [ns for _, ns in runs[1:]] + [t1]
    for i, ((phase, start), end) in enumerate(zip(runs, ends)):
        if i:
            ax.axvline((start - t0) / 1e6, color="#555555", linestyle=(0, (2, 2)), linewidth=0.9, gid="phase-boundary")
        if end - start >= LABEL_SPAN * (t1 - t0):
            ax.annotate(phase, ((start + end - 2 * t0) / 2e6, 1.0), xycoords=ax.get_xaxis_transform(), xytext=(0, -3),
                        textcoords="offset points", ha="center", va="top", fontsize=8, color="#333333", gid="phase")


def _mark_peak(ax, trace: Any, s: dict, x: list, device: str) -> None:
    """The window's peak (baseline included), as the trace computes it: a marker, its value and its op."""
    totals = [sum(row) for row in s["bytes"]]
    peak = trace.peak_bytes(device) + trace.baseline_bytes(device)
    if not totals or peak <= 0:
        return
    i = max(range(len(totals)), key=totals.__getitem__)
    label = f"peak {peak / MIB:,.2f} MiB"
    if s["event"][i] >= 0:
        op = trace.events[s["event"][i]].op
        if op >= 0:
            op = trace.ops[op]
            label += f" at {op.name} ({op.phase})"
    ax.plot([x[i]], [peak / MIB], marker="v", markersize=8, color="black", linestyle="none", gid="peak")
    right = x[i] > (x[0] + x[-1]) / 2  # the label on the side with room
    ax.annotate(label, (x[i], peak / MIB), xytext=(-6 if right else 6, 6), textcoords="offset points",
                ha="right" if right else "left", fontsize=8, gid="peak")


def memory_timeline_figure(trace: Any, device: str = "cpu", forecast_peak: int | None = None,
                           measured_peak: int | None = None, capacity: int | None = None):
    """Memory held by category over the traced window, with phase boundaries, the peak, and the lines given."""
    Figure = require_matplotlib("gpucast's memory timeline")
    s = memory_series(trace, device)
    t0, t1 = s["time_ns"][0], json.loads(trace.handle.header_json())["end_ns"]  # the series begins at start_ns
    times = s["time_ns"] + [max(t1, s["time_ns"][-1])]  # held until the window's end
    x = [(t - t0) / 1e6 for t in times]
    fig = Figure(figsize=(10, 4.8), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    columns = list(zip(*(s["bytes"] + s["bytes"][-1:]))) if s["bytes"] else [[] for _ in s["categories"]]
    ys = [[v / MIB for v in col] for col in columns]
    ax.stackplot(x, *ys, labels=s["categories"], colors=[COLORS.get(c, "#999999") for c in s["categories"]],
                 step="post", alpha=0.9)
    _mark_phases(ax, trace, t0, times[-1])
    _mark_peak(ax, trace, s, x, device)
    for gid, value, label, style in _line_labels(forecast_peak=forecast_peak, measured_peak=measured_peak,
                                                 capacity=capacity):
        ax.axhline(value / MIB, color="black", linestyle=style, linewidth=1.2, label=label, gid=gid)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.12)  # room for the phase names and the peak's label
    ax.set_xlabel("time in the traced window (ms)")
    ax.set_ylabel(f"{device} memory held (MiB)")
    ax.set_title(f"gpucast memory timeline ({device})")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=8, ncol=5, frameon=False)
    ax.margins(x=0)
    fig.tight_layout()
    return fig


def save_memory_png(trace: Any, path: str, device: str = "cpu", **lines: Any) -> None:
    require_matplotlib("Trace.save_memory_png")
    fig = memory_timeline_figure(trace, device, **lines)
    try:
        fig.savefig(str(path), format="png")
    except OSError as e:
        raise OSError(f"cannot write '{path}': {e.strerror}") from e


def save_html_report(trace: Any, path: str, device: str = "cpu", **lines: Any) -> None:
    """A self-contained HTML page: the summary and the memory timeline (embedded PNG) with the lines given."""
    require_matplotlib("Trace.save_html")
    buf = io.BytesIO()
    memory_timeline_figure(trace, device, **lines).savefig(buf, format="png")
    png = base64.b64encode(buf.getvalue()).decode("ascii")
    ctx = trace.context
    drawn = "; ".join(label for _, _, label, _ in _line_labels(**lines))
    caption = f"<p>Lines drawn: {html.escape(drawn)}.</p>\n" if drawn else ""
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>gpucast report</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}}pre{{background:#f6f6f6;padding:1em;overflow:auto}}</style>
</head><body>
<h1>gpucast report</h1>
<p>gpucast {html.escape(ctx.get("gpucast_version", ""))}, torch {html.escape(ctx.get("torch_version", ""))},
{html.escape(ctx.get("device", ""))}</p>
<img alt="memory timeline" src="data:image/png;base64,{png}">
{caption}<h2>Summary</h2>
<pre>{html.escape(trace.summary())}</pre>
</body></html>
"""
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as e:
        raise OSError(f"cannot write '{path}': {e.strerror}") from e


def memory_snapshot(trace: Any) -> dict:
    """The trace in PyTorch's memory-snapshot format (torch.cuda.memory._snapshot())."""
    return json.loads(trace.handle.memory_snapshot_json())


def save_memory_snapshot(trace: Any, path: str) -> None:
    """Pickle, as torch.cuda.memory._dump_snapshot writes: opens in https://pytorch.org/memory_viz."""
    try:
        with open(path, "wb") as f:
            pickle.dump(memory_snapshot(trace), f)
    except OSError as e:
        raise OSError(f"cannot write '{path}': {e.strerror}") from e
