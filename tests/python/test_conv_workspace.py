"""cuDNN workspaces measured at the target batch (torch.ops.gpucast.conv_calls and measure_conv_workspaces, through
gpucast/_conv_workspace.py): which calls a probe holds, from a probe recorded on an H200, and the measurement itself,
run here on the CPU through the same memory trace. A call's transient bytes: tests/cpp/test_workspace_calls.cpp."""
import gzip
import json
from pathlib import Path

import torch

import gpucast
from gpucast import _conv_workspace

DATA = Path(__file__).resolve().parents[1] / "data"


def test_the_convolution_calls_of_a_gpu_probe():
    probe = torch.ops.gpucast.trace_from_json(gzip.decompress((DATA / "gpu_probes" / "cnn_2.json.gz").read_bytes())
                                              .decode())
    calls = _conv_workspace.conv_calls(probe)
    assert calls == {
        # The first convolution's input is the data: its backward computes no input gradient.
        "CNN.features.0": {"backward": True, "input_grad": False, "input_shape": [8, 3, 32, 32],
                           "input_dtype": "float32", "weight_dtype": "float32"},
        "CNN.features.4": {"backward": True, "input_grad": True, "input_shape": [8, 32, 16, 16],
                           "input_dtype": "float32", "weight_dtype": "float32"},
        "CNN.features.8": {"backward": True, "input_grad": True, "input_shape": [8, 64, 8, 8],
                           "input_dtype": "float32", "weight_dtype": "float32"},
    }


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.other = torch.nn.Linear(4, 4)


def test_measured_on_the_device_of_the_probes():
    torch.manual_seed(0)
    net = Net()
    before = [p.detach().clone() for p in net.parameters()]
    calls = {"Net.conv": {"backward": True, "input_grad": True, "input_shape": [2, 16, 32, 32],
                          "input_dtype": "float32", "weight_dtype": "float32"},
             "Net.other": {"backward": False, "input_grad": False, "input_shape": [2, 4],
                           "input_dtype": "float32", "weight_dtype": "float32"}}
    ws, skipped = _conv_workspace.measure(net, calls, 64, "cpu")
    assert sorted(ws) == ["Net.conv|backward", "Net.conv|forward"]
    assert all(isinstance(v, int) and v >= 0 for v in ws.values())
    assert skipped == ["Net.other (not a torch.nn.ConvNd with zero padding)"]
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    assert all(p.grad is None for p in net.parameters())
    # The measurement is the call's own: the same convolution traced directly holds as much above its output.
    x = torch.zeros(64, 16, 32, 32)
    with gpucast.trace(record_shapes=False, device_timing=False) as t, torch.no_grad():
        y = net.conv(x)
    h = t.result.handle
    series = json.loads(h.memory_series("cpu"))["bytes"]  # from what was held at the start
    assert ws["Net.conv|forward"] == h.peak_bytes("cpu") - (sum(series[-1]) - sum(series[0]))
    del y


def test_a_failure_leaves_the_probes_workspaces():
    ws, skipped = _conv_workspace.measure_quietly(Net(), {"ops": None}, 8, "cpu")
    assert ws == {} and len(skipped) == 1 and skipped[0].startswith("every call (ValueError: [gpucast:argument] ")
