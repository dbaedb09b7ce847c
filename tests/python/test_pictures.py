"""Pictures and exports: memory timeline PNG and HTML for the zoo, PyTorch's memory-snapshot format."""
import base64
import json
import pickle
import re
import sys

import numpy as np
import pytest
import torch
import torch.cuda._memory_viz as memory_viz
from matplotlib.image import imread

import gpucast
from conftest import build
from examples import zoo


def traced(name):
    model, opt, step, batch = build(zoo.CASES[name], "adamw")
    step(batch)
    with gpucast.trace() as t:
        step(batch)
    return t


@pytest.mark.parametrize("name", sorted(zoo.CASES))
def test_png_and_html_are_not_blank(name, tmp_path):
    t = traced(name)
    png = tmp_path / "timeline.png"
    t.save_memory_png(str(png), forecast_peak=t.peak_bytes() + t.baseline_bytes(), capacity=None)
    img = imread(str(png))[..., :3]
    assert img.shape[0] >= 400 and img.shape[1] >= 800
    # Not blank: a good share of non-white pixels, and several distinct colours (the stacked categories).
    non_white = np.mean(img.mean(axis=2) < 0.95)
    assert non_white > 0.2, non_white
    colours = {tuple(c) for c in (img[::7, ::7] * 255).astype(int).reshape(-1, 3)}
    assert len(colours) > 20
    page = tmp_path / "report.html"
    t.save_html(str(page))
    text = page.read_text()
    assert "<h1>gpucast report</h1>" in text and "gpucast trace:" in text
    embedded = re.search(r'src="data:image/png;base64,([^"]+)"', text).group(1)
    assert base64.b64decode(embedded)[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_snapshot_loads_with_pytorch_memory_viz(tmp_path):
    t = traced("gpt")
    path = tmp_path / "snapshot.pickle"
    t.save_memory_snapshot(str(path))
    with open(path, "rb") as f:
        snap = pickle.load(f)
    cpu_trace = snap["device_traces"][-1]  # the CPU's is the last (meta storages, if any, have their own before it)
    allocs = [e for e in cpu_trace if e["action"] == "alloc"]
    frees = [e for e in cpu_trace if e["action"] == "free_requested"]
    assert len(allocs) == (sum(1 for a in t.allocations if a.baseline and a.device == "cpu")
                           + sum(1 for e in t.events if e.bytes > 0 and e.device == "cpu"))
    assert len(frees) == sum(1 for e in t.events if e.bytes < 0 and e.device == "cpu")
    text = memory_viz.trace(snap)
    assert f"Device {len(snap['device_traces']) - 1} ----------------\n{len(cpu_trace)} entries" in text
    assert "total_reserved" in memory_viz.segsum(snap)
    assert "Active Memory Timeline" in memory_viz.trace_plot(snap)
    assert "Allocator State History" in memory_viz.segment_plot(snap)
    live = sum(a.block_bytes for a in t.allocations if a.free_event < 0)
    assert sum(b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated") == live


def test_unwritable_picture_paths_are_named(tmp_path):
    t = traced("mlp")
    with pytest.raises(OSError, match=r"cannot write '/nonexistent-dir/x.png'"):
        t.save_memory_png("/nonexistent-dir/x.png")
    with pytest.raises(OSError, match=r"cannot write '/nonexistent-dir/x.html'"):
        t.save_html("/nonexistent-dir/x.html")
    with pytest.raises(OSError, match=r"cannot write '/nonexistent-dir/x.pickle'"):
        t.save_memory_snapshot("/nonexistent-dir/x.pickle")


MIB = 2**20


def test_phase_starts_follow_the_training_threads():
    """A lone op on another thread (phase forward: it is neither in backward nor in the optimizer) does not break
    the backward in two; backward ops on a thread of their own (autograd's device threads) count."""
    from types import SimpleNamespace
    from gpucast._pictures import phase_starts

    def ops(*rows):
        return SimpleNamespace(ops=[SimpleNamespace(thread=th, phase=ph, start_ns=ns, depth=d) for th, ph, ns, d in rows])
    cpu = ops((1, "optimizer", 0, 0), (1, "forward", 10, 0), (1, "forward", 11, 1), (1, "backward", 20, 0),
              (2, "forward", 25, 0), (1, "backward", 30, 0), (1, "optimizer", 40, 0), (1, "forward", 50, 0))
    assert phase_starts(cpu) == [("optimizer", 0), ("forward", 10), ("backward", 20), ("optimizer", 40),
                                 ("forward", 50)]
    cuda = ops((1, "forward", 10, 0), (2, "backward", 20, 0), (3, "forward", 25, 0), (2, "backward", 30, 0),
               (1, "forward", 35, 0), (2, "backward", 37, 0), (1, "optimizer", 40, 0))
    assert phase_starts(cuda) == [("forward", 10), ("backward", 20), ("forward", 35), ("backward", 37),
                                  ("optimizer", 40)]
    assert phase_starts(ops()) == []


def by_gid(artists, gid):
    return [a for a in artists if a.get_gid() == gid]


def test_timeline_marks_phases_peak_forecast_and_capacity():
    from gpucast._pictures import LABEL_SPAN, memory_timeline_figure, phase_starts
    t = traced("mlp")
    peak = t.peak_bytes() + t.baseline_bytes()
    fig = memory_timeline_figure(t, forecast_peak=peak * 3 // 2, capacity=peak * 3)
    ax = fig.axes[0]
    runs = phase_starts(t)  # tested above
    # zero_grad, forward, backward, the optimizer's step (then the step function's loss.detach(), a forward op)
    assert [p for p, _ in runs][:4] == ["optimizer", "forward", "backward", "optimizer"]
    t0 = t.result._head()["start_ns"]
    boundaries = by_gid(ax.lines, "phase-boundary")
    assert [b.get_xdata()[0] for b in boundaries] == pytest.approx([(ns - t0) / 1e6 for _, ns in runs[1:]])
    assert all(b.get_xdata()[0] == b.get_xdata()[1] for b in boundaries)  # vertical
    # Each phase's name centred over its span, where the span is wide enough (LABEL_SPAN of the window).
    head = json.loads(t.handle.header_json())
    ends = [ns for _, ns in runs[1:]] + [head["end_ns"]]
    named = [(p, (a + b - 2 * t0) / 2e6) for (p, a), b in zip(runs, ends) if b - a >= LABEL_SPAN * (ends[-1] - t0)]
    assert {"forward", "backward", "optimizer"} <= {p for p, _ in named}
    assert [(x.get_text(), x.xy[0]) for x in by_gid(ax.texts, "phase")] == [(p, pytest.approx(x)) for p, x in named]
    op, name, phase = re.search(r"window peak .* at op #(\d+) (\S+) \((\w+)\)", t.summary()).groups()
    marker, = by_gid(ax.lines, "peak")
    assert marker.get_ydata()[0] == pytest.approx(peak / MIB) and marker.get_marker() not in (None, "", "None")
    assert [x.get_text() for x in by_gid(ax.texts, "peak")] == [f"peak {peak / MIB:,.2f} MiB at {name} ({phase})"]
    for gid, value, label in (("forecast", peak * 3 // 2, "forecast peak"), ("capacity", peak * 3, "capacity")):
        line, = by_gid(ax.lines, gid)
        assert list(line.get_ydata()) == pytest.approx([value / MIB] * 2)
        assert line.get_label() == f"{label} {value / MIB:,.1f} MiB"
    assert ax.get_ylim()[1] > peak * 3 / MIB
    plain = memory_timeline_figure(t).axes[0]
    assert not by_gid(plain.lines, "forecast") and not by_gid(plain.lines, "capacity")
    assert len(by_gid(plain.lines, "peak")) == 1 and len(by_gid(plain.lines, "phase-boundary")) == len(runs) - 1


def test_html_names_the_lines_it_draws(tmp_path):
    t = traced("mlp")
    t.save_html(str(tmp_path / "r.html"), forecast_peak=1234 * MIB, capacity=80 * 2**30)
    text = (tmp_path / "r.html").read_text()
    assert "forecast peak 1,234.0 MiB" in text and "capacity 81,920.0 MiB" in text


def test_missing_matplotlib_is_one_line(tmp_path, monkeypatch):
    t = traced("mlp")
    for name in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)  # as if matplotlib were not installed
    with pytest.raises(ImportError) as e:
        t.save_memory_png(str(tmp_path / "x.png"))
    assert str(e.value) == "Trace.save_memory_png needs matplotlib: pip install matplotlib"
    assert e.value.__cause__ is None and e.value.__suppress_context__
    with pytest.raises(ImportError, match=r"^Trace.save_html needs matplotlib: pip install matplotlib$"):
        t.save_html(str(tmp_path / "x.html"))
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "x.html").exists()
