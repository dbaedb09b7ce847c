"""Write the fuzz corpus's real files (tests/data/fuzz/<target>/): small traces recorded with the public API, job
descriptions from gpucast.describe() and the job dataset, the shipped weights files and GPU rates table, recorded
step graphs, and configuration strings as users write them. Known faults' inputs (known/) and the fuzzer's own
finds (crashes/) are not written here.

    PYTHONPATH=python:. .venv/bin/python tests/fuzz/make_corpus.py
"""
from __future__ import annotations

import gzip
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "data" / "fuzz"
sys.path[:0] = [str(ROOT), str(ROOT / "python")]


def write(target: str, name: str, data: bytes | str) -> None:
    d = OUT / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data.encode() if isinstance(data, str) else data)


def tiny_models():
    import torch
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    cnn = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                              torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 3))

    class Tok(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, 8)
            self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
            self.norm = torch.nn.LayerNorm(8)
            self.head = torch.nn.Linear(8, 32)

        def forward(self, x):
            h = self.emb(x)
            h = self.norm(h + self.attn(h, h, h, need_weights=False)[0])
            return self.head(h)

    # (name, model, make_batch, optimizer, iterations traced): small enough that a mutation costs milliseconds
    return [("tiny_mlp", mlp, lambda n: torch.randn(n, 8), torch.optim.SGD, 2),
            ("tiny_cnn", cnn, lambda n: torch.randn(n, 1, 6, 6), torch.optim.SGD, 1),
            ("tiny_attention", Tok(), lambda n: torch.randint(0, 32, (n, 5)), torch.optim.SGD, 1)]


def traces_and_jobs() -> None:
    import gpucast
    for name, model, make_batch, opt_class, iterations in tiny_models():
        opt = opt_class(model.parameters(), lr=0.01)
        x = make_batch(2)
        with gpucast.trace(model=model) as t:
            for _ in range(iterations):
                out = model(x)
                out.float().sum().backward()
                opt.step()
                opt.zero_grad()
                gpucast._trace.mark_iteration_end()
        path = OUT / "trace" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        t.save(str(path))
        job = gpucast.describe(model, make_batch, 64, optimizer=opt)
        write("job", f"{name}.json", json.dumps(job, indent=1))
    # Jobs of the dataset the job model was trained on: one of each family.
    seen = set()
    with gzip.open(ROOT / "bench" / "dataset" / "jobs.jsonl.gz", "rt") as f:
        for line in f:
            rec = json.loads(line)
            fam = rec["job"]["family"]
            if fam not in seen and len(line) < 20000:
                seen.add(fam)
                write("job", f"dataset_{fam}.json", json.dumps(rec["job"], indent=1))


def files() -> None:
    weights = ROOT / "predictor" / "weights"
    for target, name in (("job_weights", "job_memory.gcw"), ("step_gnn_weights", "step_gnn.gcw"),
                         ("gpu_rates", "gpu_rates.json")):
        (OUT / target).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(weights / name, OUT / target / name)
    table = json.loads((weights / "gpu_rates.json").read_text())
    table["gpus"] = [g for g in table["gpus"] if g["name"] == "H100-80GB"]
    write("gpu_rates", "h100_only.json", json.dumps(table, indent=1))
    # Recorded step graphs (the graph network's input), the smallest few of the step-time dataset.
    lines = []
    for rec in ("step_times.jsonl.gz", "step_times_2.jsonl.gz"):
        with gzip.open(ROOT / "bench" / "dataset" / rec, "rt") as f:
            lines += [line for line in f]
    lines.sort(key=len)
    graphs = {}
    for line in lines:
        g = json.loads(line)
        if g["model"] not in graphs and len(graphs) < 3:
            graphs[g["model"]] = line
    first = json.loads(gzip.open(ROOT / "bench" / "dataset" / "step_times.jsonl.gz", "rt").readline())
    graphs[first["model"]] = json.dumps(first)
    for model, line in graphs.items():
        write("step_graph", f"{model}.json", line.strip())


CONFIGS = {
    "auto_config": ["enabled:True", "enabled:True,target:H100-80GB,capacity_mb:81920,warn_fraction:0.9,on_risk:warn",
                    "target:cpu,on_risk:raise", "enabled:False,target:auto,capacity_mb:0,warn_fraction:1"],
    "link": ["intra:nvlink4,gpus_per_node:8,inter:ib-ndr", "alpha_us:35,bytes_per_us:1200",
             "alpha_us:35,bytes_per_us:1200,ranks:2,samples:65536/90;1048576/900;16777216/14000,"
             "send_samples:65536/40;4194304/2100",
             "intra:pcie4,gpus_per_node:4,overlap:0.5,memory_contention:1.2,sync_wait_us:10"],
    "parallel": ["dp:2", "dp:2,dp_mode:ddp,bucket_cap_mb:25,gradient_as_bucket_view:True,broadcast_buffers:False",
                 "dp:4,dp_mode:fsdp,fsdp_units:Sequential.0|Sequential.2", "tp:2,pp:2,micro_batches:4",
                 "dp:4,dp_mode:zero2,buffer_bytes:4096"],
    "alloc_conf": ["expandable_segments:True", "max_split_size_mb:64,garbage_collection_threshold:0.6",
                   "roundup_power2_divisions:4", "backend:native,max_non_split_rounding_mb:64,large_segment_size_mb:32",
                   "pinned_use_cuda_host_register:True,expandable_segments:False"],
}


def configs() -> None:
    for target, texts in CONFIGS.items():
        for i, text in enumerate(texts):
            write(target, f"seed_{i}.txt", text)


def _json_with(src: Path, change) -> bytes:
    doc = json.loads(src.read_bytes())
    change(doc)
    return json.dumps(doc).encode()


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _weights_with(src: Path, tensor: str | None = None, header: tuple | None = None) -> bytes:
    """A copy of a weights file with one weight set to 3e38 or one header statistic set to 0, the checksum valid."""
    import array
    sys.path.insert(0, str(ROOT / "tests" / "fuzz"))
    import mutate
    w = mutate.parse_weights(src.read_bytes())
    if tensor is not None:
        for t in w["tensors"]:
            if t[0] == tensor.encode():
                t[2][0] = array.array("f", [3e38])[0]
    if header is not None:
        h = json.loads(w["header"])
        h[header[0]][header[1]] = 0.0
        w["header"] = json.dumps(h).encode()
    return mutate.build_weights(w)


def known() -> None:
    """The inputs of the faults issue 33 lists (tests/data/fuzz/<target>/known/), built from the corpus."""
    trace = OUT / "trace" / "tiny_mlp.json"
    job = OUT / "job" / "tiny_mlp.json"

    def alloc_op(d):
        next(a for a in d["allocations"] if a["alloc_op"] >= 0)["alloc_op"] = 1000000

    def event_allocation(d):
        d["events"][0]["allocation"] = 1000000

    for name, data in [
        ("alloc_op_out_of_range.json", _json_with(trace, alloc_op)),
        ("event_allocation_out_of_range.json", _json_with(trace, event_allocation)),
        ("ops_nested_100000.json", _json_with(trace, lambda d: d.update(ops="@")).replace(
            b'"@"', _nested(100000).encode())),
        ("start_ns_1e400.json", _json_with(trace, lambda d: d.update(start_ns="@")).replace(b'"@"', b"1e400")),
        ("counters_array.json", _json_with(trace, lambda d: d.update(counters=[1, 2]))),
        ("op_name_invalid_utf8.json", _json_with(trace, lambda d: d["ops"][0].update(name="@")).replace(
            b'"@"', b'"aten::\xff"')),
    ]:
        write("trace/known", name, data)
    for name, data in [
        ("layers_nested_100000.json", _json_with(job, lambda d: d.update(layers="@")).replace(
            b'"@"', _nested(100000).encode())),
        ("schema_version_4294967297.json", _json_with(job, lambda d: d.update(schema_version=4294967297))),
        ("schema_version_uint64_max.json", _json_with(job, lambda d: d.update(schema_version=18446744073709551615))),
        ("batch_size_1e400.json", _json_with(job, lambda d: d.update(batch_size="@")).replace(b'"@"', b"1e400")),
        ("dtype_invalid_utf8.json", _json_with(job, lambda d: d.update(dtype="@")).replace(b'"@"', b'"float\xff"')),
    ]:
        write("job/known", name, data)
    jw = OUT / "job_weights" / "job_memory.gcw"
    write("job_weights/known", "head_bias_3e38.gcw", _weights_with(jw, tensor="head2.bias"))
    write("job_weights/known", "job_std_zero.gcw", _weights_with(jw, header=("job_std", 0)))
    gw = OUT / "step_gnn_weights" / "step_gnn.gcw"
    write("step_gnn_weights/known", "head_bias_3e38.gcw", _weights_with(gw, tensor="m0.head2.bias"))
    write("step_gnn_weights/known", "node_std_zero.gcw", _weights_with(gw, header=("node_std", 0)))
    rates = (OUT / "gpu_rates" / "h100_only.json").read_bytes()
    write("gpu_rates/known", "bad_byte.json", rates.replace(b'"H100-80GB"', b'"H100-80GB\xff"', 1))
    write("gpu_rates/known", "wrong_type.json", rates.replace(b'"fp32_tflops": 66.9', b'"fp32_tflops": "66.9"', 1))
    write("auto_config/known", "capacity_mb_int64_max.txt", "enabled:True,capacity_mb:9223372036854775807")
    write("alloc_conf/known", "roundup_power2_divisions_list.txt", "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")


if __name__ == "__main__":
    if sys.argv[1:] == ["--known"]:
        known()
    else:
        files()
        configs()
        traces_and_jobs()
    print(f"wrote {OUT}")
