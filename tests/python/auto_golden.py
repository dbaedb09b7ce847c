"""One training run of a zoo case in auto mode, in this process: the forecast auto mode logged and the peak the run
measured. Run as a script (a fresh process per case): prints one JSON object.

    python tests/python/auto_golden.py CASE ROUTE STYLE LOG

ROUTE: "import" (import gpucast) or "load_library" (torch.ops.load_library only). STYLE: "loop" (a loop body as
scripts write it, `loss` rebound each iteration) or "step" (examples.zoo.make_step: a function, its loss freed when
it returns). GPUCAST_CONF comes from the environment. The measured peak: the most CPU bytes held through gpucast's allocator wrapper over three
iterations, above what was held before the first (the forecast's peak_allocated_bytes counts the same)."""
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]

import torch  # noqa: E402

case_name, route, style, log = sys.argv[1:5]
if route == "import":
    import gpucast  # noqa: F401
else:
    torch.ops.load_library(os.environ.get("GPUCAST_LIBRARY") or str(ROOT / "build" / "lib" / "libgpucast.so"))
from examples import zoo  # noqa: E402

torch.manual_seed(0)
torch.set_num_threads(1)
case = zoo.CASES[case_name]
model = case.make_model()
opt = zoo.make_optimizer("adamw", model.parameters())
inputs, targets = case.make_batch(case.default_batch)
held_before, _ = torch.ops.gpucast.cpu_memory_stats(True)
step = zoo.make_step(model, opt, case.loss_fn)
for _ in range(3):
    if style == "step":
        step((inputs, targets))
        continue
    # A training loop as scripts write it: `loss` holds the last iteration's loss until rebound.
    opt.zero_grad(set_to_none=True)
    loss = case.loss_fn(model(inputs), targets)
    loss.backward()
    opt.step()
held_after, peak = torch.ops.gpucast.cpu_memory_stats(False)
rec = json.loads(Path(log).read_text().splitlines()[-1])["memory"]
print(json.dumps({"case": case_name, "route": route, "style": style, "batch": case.default_batch,
                  "status": json.loads(torch.ops.gpucast.auto_status()),
                  "measured_peak": peak, "held_before": held_before,
                  "forecast": {k: rec[k] for k in ("peak_allocated_bytes", "peak_reserved_bytes",
                                                   "first_iteration_peak_bytes", "steady_peak_bytes")},
                  "breakdown": rec["breakdown"]}))
