"""Auto mode with torch.ops.load_library only: no `import gpucast`, the plugin and an environment variable.

    GPUCAST_CONF="enabled:True,target:H100-80GB,capacity_mb:600" python examples/load_library.py

The plugin traces the first iteration, forecasts the run and, before the second iteration allocates, warns (c10's
warning on stderr, "Warning: gpucast: out-of-memory risk ...") or, with on_risk:raise, fails the second iteration's
first allocation with a RuntimeError. GPUCAST_LOG=forecasts.jsonl appends the forecast as a JSON line.
"""
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
torch.ops.load_library(os.environ.get("GPUCAST_LIBRARY") or str(ROOT / "build" / "lib" / "libgpucast.so"))

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
optimizer = torch.optim.AdamW(model.parameters())
inputs, targets = torch.randn(64, 784), torch.randint(0, 10, (64,))
for i in range(1, 4):
    print(f"iteration {i} start", file=sys.stderr, flush=True)
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
print("done", file=sys.stderr)
