"""On a GPU: record the real caching allocator's history of a few training runs into tests/data/, so that CI
replays them through gpucast's allocator simulation and asserts the real peaks (tests/cpp/test_allocator_sim.cpp).

Each file holds the requested sizes of every allocation and free in order (from
torch.cuda.memory._record_memory_history / _snapshot), the allocator configuration, and the peaks the real
allocator reported: torch.cuda.max_memory_allocated() and max_memory_reserved(). Beside them, for reading a
mismatch: the real allocator's segment allocations and frees ("a"/"f", address, bytes, the number of events
before it).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]

CASES = {"mlp": 256, "cnn": 64, "gpt": 32, "resnet18": 32}


def record(name: str, batch: int, out_dir: Path) -> None:
    import torch
    from examples import zoo
    torch.manual_seed(0)
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    cases = dict(zoo.CASES)
    cases.update(zoo.real_cases())
    case = cases[name]
    model = case.make_model().cuda()
    opt = zoo.make_optimizer("adamw", model.parameters())
    step = zoo.make_step(model, opt, case.loss_fn)
    for _ in range(3):
        b = tuple(t.cuda() for t in case.make_batch(batch))
        step(b)
        del b
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events, segments = [], []
    for e in snap["device_traces"][0]:
        if e["action"] in ("alloc", "free_requested"):
            events.append([e["action"][0], e["addr"], e["size"], e.get("stream", 0)])
        elif e["action"] in ("segment_alloc", "segment_free"):  # the real allocator's cudaMalloc / cudaFree
            segments.append([e["action"][8], e["addr"], e["size"], len(events)])
    doc = {"schema_version": 1, "case": name, "batch": batch, "device": torch.cuda.get_device_name(0),
           "torch_version": torch.__version__, "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF", ""),
           "max_memory_allocated": torch.cuda.max_memory_allocated(),
           "max_memory_reserved": torch.cuda.max_memory_reserved(),
           "events": events, "segment_events": segments}
    path = out_dir / f"alloc_history_{name}.json"
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    print(f"{name}: {len(events)} events, allocated {doc['max_memory_allocated']}, reserved {doc['max_memory_reserved']}"
          f" -> {path}")


if __name__ == "__main__":
    import subprocess
    out = ROOT / "tests" / "data"
    out.mkdir(parents=True, exist_ok=True)
    if len(sys.argv) > 1:
        record(sys.argv[1], CASES[sys.argv[1]], out)
    else:
        for name in CASES:  # a fresh process each, so the history starts from an empty allocator
            subprocess.run([sys.executable, __file__, name], check=True)
