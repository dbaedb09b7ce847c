"""The shipped job model's answers against the analytical estimate it corrects, over both job datasets (the CPU jobs
and every fifth row of the GPU jobs): the range that predictor/job_model.cpp's plausibility bounds (half the smallest
to twice the largest ratio of label to analytical estimate in the training set, recorded in the weights) must
contain. Prints per dataset the count, min, median and max ratio and how many answers the bounds rejected, and
writes nothing else."""
from __future__ import annotations

import gzip
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "bench" / "dataset")]
import gpucast  # noqa: E402,F401  (loads the plugin)


def ratios(jobs) -> tuple[list[float], int]:
    out, rejected = [], 0
    for job in jobs:
        text = json.dumps(job)
        learned = json.loads(torch.ops.gpucast.predict_job(text, None))
        if learned["method"] != "learned":
            rejected += learned["notes"][0]["code"] == "learned-implausible"
            continue
        out.append(learned["bytes"] / learned["analytical_bytes"])
    return out, rejected


def main() -> None:
    cpu = [json.loads(line)["job"] for line in gzip.open(ROOT / "bench" / "dataset" / "jobs.jsonl.gz", "rt")]
    import gpu_jobs
    gpu = [r["job"] for r in gpu_jobs.training_rows(gpu_jobs.read_groups(ROOT / "bench/dataset/gpu_jobs.jsonl.gz"))]
    for name, jobs in (("CPU jobs", cpu), ("GPU jobs (every fifth)", gpu[::5])):
        r, rejected = ratios(jobs)
        print(f"{name} {len(r)}: learned / analytical min {min(r):.3f}, median {statistics.median(r):.3f}, "
              f"max {max(r):.3f}; {rejected} answers rejected as implausible")


if __name__ == "__main__":
    main()
