"""Pictures and exports: memory timeline PNG and HTML for the zoo, PyTorch's memory-snapshot format."""
import base64
import pickle
import re

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
    cpu_trace = snap["device_traces"][-1]
    allocs = [e for e in cpu_trace if e["action"] == "alloc"]
    frees = [e for e in cpu_trace if e["action"] == "free_requested"]
    assert len(allocs) == sum(1 for a in t.allocations if a.baseline) + sum(1 for e in t.events if e.bytes > 0)
    assert len(frees) == sum(1 for e in t.events if e.bytes < 0)
    text = memory_viz.trace(snap)
    assert text.startswith(f"Device {len(snap['device_traces']) - 1} ----------------\n{len(cpu_trace)} entries")
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
