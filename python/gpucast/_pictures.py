"""Pictures of a trace: the memory timeline of an iteration (PNG, matplotlib), a self-contained HTML report,
and PyTorch's memory-snapshot format for torch.cuda._memory_viz. The numbers come from C++."""
from __future__ import annotations

import base64
import html
import io
import json
import pickle
from typing import Any

COLORS = {"parameter": "#4C72B0", "gradient": "#DD8452", "optimizer_state": "#55A868", "activation": "#C44E52",
          "temporary": "#8172B3", "input": "#937860", "other": "#8C8C8C"}
MIB = 2**20


def memory_series(trace: Any, device: str = "cpu") -> dict:
    """Bytes held by category after each memory event of `device`, baseline included."""
    return json.loads(trace.handle.memory_series(device))


def memory_timeline_figure(trace: Any, device: str = "cpu", forecast_peak: int | None = None,
                           measured_peak: int | None = None, capacity: int | None = None):
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    s = memory_series(trace, device)
    t0 = s["time_ns"][0]
    x = [(t - t0) / 1e6 for t in s["time_ns"]]
    fig = Figure(figsize=(10, 4.8), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    columns = list(zip(*s["bytes"])) if s["bytes"] else [[] for _ in s["categories"]]
    ys = [[v / MIB for v in col] for col in columns]
    ax.stackplot(x, *ys, labels=s["categories"], colors=[COLORS.get(c, "#999999") for c in s["categories"]],
                 step="post", alpha=0.9)
    for value, label, style in ((forecast_peak, "forecast peak", "--"), (measured_peak, "measured peak", ":"),
                                (capacity, "capacity", "-")):
        if value:
            ax.axhline(value / MIB, color="black", linestyle=style, linewidth=1.2, label=f"{label} {value / MIB:,.1f} MiB")
    ax.set_xlabel("time in the traced window (ms)")
    ax.set_ylabel(f"{device} memory held (MiB)")
    ax.set_title(f"gpucast memory timeline ({device})")
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    ax.margins(x=0)
    fig.tight_layout()
    return fig


def save_memory_png(trace: Any, path: str, device: str = "cpu", **lines: Any) -> None:
    fig = memory_timeline_figure(trace, device, **lines)
    try:
        fig.savefig(str(path), format="png")
    except OSError as e:
        raise OSError(f"cannot write '{path}': {e.strerror}") from e


def save_html_report(trace: Any, path: str, device: str = "cpu", **lines: Any) -> None:
    """A self-contained HTML page: the summary and the memory timeline (embedded PNG)."""
    buf = io.BytesIO()
    memory_timeline_figure(trace, device, **lines).savefig(buf, format="png")
    png = base64.b64encode(buf.getvalue()).decode("ascii")
    ctx = trace.context
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>gpucast report</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}}pre{{background:#f6f6f6;padding:1em;overflow:auto}}</style>
</head><body>
<h1>gpucast report</h1>
<p>gpucast {html.escape(ctx.get("gpucast_version", ""))}, torch {html.escape(ctx.get("torch_version", ""))},
{html.escape(ctx.get("device", ""))}</p>
<img alt="memory timeline" src="data:image/png;base64,{png}">
<h2>Summary</h2>
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
