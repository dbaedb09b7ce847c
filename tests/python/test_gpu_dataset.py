"""The GPU-job dataset (bench/dataset/gpu_jobs.py): the committed groups are whole and consistent, their rows become
valid job descriptions, and a group regenerated from the seed equals the committed one."""
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gpucast

ROOT = Path(__file__).resolve().parents[2]
DATASET = ROOT / "bench/dataset/gpu_jobs.jsonl.gz"
sys.path.insert(0, str(ROOT / "bench" / "dataset"))
import gpu_jobs  # noqa: E402


@pytest.fixture(scope="module")
def groups():
    with gzip.open(DATASET, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_groups_are_whole_and_consistent(groups):
    assert [g["group"] for g in groups] == sorted({g["group"] for g in groups})
    assert {g["family"] for g in groups} == set(gpu_jobs.FAMILIES)
    ok = [g for g in groups if "error" not in g]
    assert len(ok) >= 0.95 * len(groups)
    rows = [r for g in ok for r in g["rows"]]
    assert all(len(g["rows"]) == gpu_jobs.ROWS_PER_GROUP for g in ok)
    priced = [r for r in rows if "error" not in r]
    assert len(priced) >= 0.98 * len(rows)
    assert all(0 < r["allocated_bytes"] <= r["reserved_bytes"] for r in priced)
    assert {r["gpu"] for r in priced} == set(gpu_jobs.GPUS)
    for r in priced:
        lay = r["layout"]
        world = lay.get("dp", 1) * lay.get("tp", 1) * lay.get("pp", 1)
        assert world in gpu_jobs.WORLDS
        assert r["global_batch"] == r["batch_per_rank"] * lay.get("dp", 1) * lay.get("micro_batches", 1)
    params = [g["params"] for g in ok]
    assert min(params) < 2e7 and max(params) > 1e10


def test_rows_become_job_descriptions(groups):
    sample = [g for g in groups if "error" not in g][::25]
    rows = gpu_jobs.training_rows(sample)
    assert len(rows) == sum(1 for g in sample for r in g["rows"] if "error" not in r)
    for r in rows[::7]:
        assert r["label_source"] == "forecast-gpu" and r["job"]["schema_version"] == 2
        assert r["label_reserved_bytes"] >= r["label_bytes"]
        e = gpucast.predict_job(r["job"], weights="")  # validates the description
        assert e["bytes"] > 0
        assert r["job"]["target"] in gpu_jobs.GPUS and r["job"]["world_size"] in gpu_jobs.WORLDS


def test_same_seed_same_group(groups):
    """The quickest committed meta-probe group, regenerated in a fresh process, equals the committed record."""
    meta = [g for g in groups if "error" not in g and g.get("probe") == "meta"]
    g = min(meta, key=lambda x: x["probe_seconds"])
    out = subprocess.run(
        [sys.executable, "-c", "import json, sys; sys.path[:0] = ['.', 'python', 'bench/dataset']; "
         f"import gpu_jobs as g; print(json.dumps(g.run_group({g['group']}, {g['seed']})))"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH="python:."))
    assert out.returncode == 0, out.stderr
    again = json.loads(out.stdout.strip().splitlines()[-1])
    timing = ("probe_seconds", "seconds")
    assert {k: v for k, v in again.items() if k not in timing} == {k: v for k, v in g.items() if k not in timing}
