"""The shipped job model's answers against the analytical estimate it corrects, over the job dataset: the range
that predictor/job_model.cpp's plausibility bounds (0.25x-4x) must contain. Prints the count, min, median and max
ratio, and writes nothing else."""
from __future__ import annotations

import gzip
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import gpucast  # noqa: E402,F401  (loads the plugin)


def main() -> None:
    ratios = []
    for line in gzip.open(Path(__file__).resolve().parent / "dataset" / "jobs.jsonl.gz", "rt"):
        job = json.dumps(json.loads(line)["job"])
        learned = json.loads(torch.ops.gpucast.predict_job(job, None))
        if learned["method"] != "learned":
            continue
        analytical = json.loads(torch.ops.gpucast.predict_job(job, "/nonexistent"))
        ratios.append(learned["bytes"] / analytical["bytes"])
    print(f"jobs {len(ratios)}: learned / analytical min {min(ratios):.3f}, median {statistics.median(ratios):.3f}, "
          f"max {max(ratios):.3f}")


if __name__ == "__main__":
    main()
