"""The step-time graph network (ScaleDL's GNN): training with `gpucast-train step-gnn` on synthetic graphs, the
correction it recovers, the fallback to alpha = beta = 1 for missing and bad weights, and graph validation."""
import gzip
import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpucast
from gpucast._errors import error_code
from conftest import rewrite_weights_header

ROOT = Path(__file__).resolve().parents[2]
# gpucast-train sits in bin/ beside the lib/ the plugin was loaded from (build/ or $GPUCAST_LIBRARY's build tree).
TRAIN = Path(gpucast.library_path()).resolve().parents[1] / "bin" / "gpucast-train"
FIX = "; retrain with gpucast-train step-gnn or reinstall gpucast to get the shipped weights"
# The synthetic truth: step_ms = alpha * sum_layers_ms + beta * comm_ms, per family; the families differ in their
# layer kinds (convolutions or matrix products), which only the node features show.
TRUTH = {"convnet": (1.3, 1.0), "transformer": (0.8, 1.5)}
KINDS = {"convnet": ["conv", "conv", "norm", "elementwise", "pool"],
         "transformer": ["matmul", "matmul", "attention", "norm", "elementwise", "embedding"]}


def synthetic_graph(rng, family, nodes=(8, 30)):
    n = rng.randint(*nodes)
    peak, bw = rng.choice([(100.0, 20.0), (400.0, 50.0), (19500.0, 1555.0)])
    layers = []
    for _ in range(n):
        flops, size = 10 ** rng.uniform(6, 10), 10 ** rng.uniform(4, 8)
        layers.append({"kind": rng.choice(KINDS[family]), "flops": flops, "bytes": size,
                       "pred_ms": flops / (peak * 1e6) + size / (bw * 1e6)})
    edges = [[i, i + 1, layers[i]["bytes"] / 2] for i in range(n - 1)]
    edges += [[i, i + 2, layers[i]["bytes"] / 4] for i in range(0, n - 2, 3)]  # skip connections
    world = rng.choice([1, 2, 4])
    sum_ms = sum(x["pred_ms"] for x in layers)
    comm_ms = 0.0 if world == 1 else sum_ms * rng.uniform(0.1, 0.5)
    alpha, beta = TRUTH[family]
    return {"family": family, "model": f"{family}-{n}",
            "global": {"batch": rng.choice([8, 16, 32]), "threads": 1, "optimizer": rng.choice(["sgd", "adamw"]),
                       "world": world, "strategy": "single" if world == 1 else "ddp", "peak_gflops": peak,
                       "mem_gbps": bw},
            "nodes": layers, "edges": edges, "sum_layers_ms": sum_ms, "comm_ms": comm_ms,
            "measured_ms": (alpha * sum_ms + beta * comm_ms) * math.exp(rng.gauss(0, 0.02))}


def synthetic(seed, count):
    """count graphs, each a case of its own (a model name of its own: graphs of one name, batch, optimizer and
    world are recordings of one case to the trainer)."""
    rng = random.Random(seed)
    graphs = [synthetic_graph(rng, ["convnet", "transformer"][i % 2]) for i in range(count)]
    return [dict(g, model=f"{g['model']}-s{seed}-{i}") for i, g in enumerate(graphs)]


def write_jsonl(path, graphs):
    path.write_text("".join(json.dumps(g) + "\n" for g in graphs))
    return path


def train(tmp, out, *args, train_graphs=240, val_graphs=60):
    t = write_jsonl(tmp / "train.jsonl", synthetic(1, train_graphs))
    v = write_jsonl(tmp / "val.jsonl", synthetic(2, val_graphs))
    r = subprocess.run([str(TRAIN), "step-gnn", "--train", str(t), "--val", str(v), "--out", str(out), "--threads", "1",
                        *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def correction(graph, weights):
    return json.loads(torch.ops.gpucast.step_correction(json.dumps(graph), str(weights)))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("step_gnn")
    info = train(tmp, tmp / "w.gcw", "--seed", "0", "--epochs", "150")
    return tmp / "w.gcw", info


def test_training_recovers_the_correction(trained):
    path, info = trained
    assert (info["train_graphs"], info["val_graphs"]) == (240, 60)
    assert info["best_epoch"] > 0 and info["val_mse_log"] < 0.005, info
    for g in synthetic(3, 30):
        c = correction(g, path)
        alpha, beta = TRUTH[g["family"]]
        assert c["source"] == "gnn"
        assert abs(c["alpha"] / alpha - 1) < 0.10, (g["family"], c)
        assert c["step_ms"] == pytest.approx(c["alpha"] * g["sum_layers_ms"] + c["beta"] * g["comm_ms"])
        if g["comm_ms"] > 0:
            assert abs(c["beta"] / beta - 1) < 0.25, (g["family"], c)
    # A lone layer without edges, nothing to predict against: still an answer.
    lone = dict(synthetic(4, 1)[0], edges=[], measured_ms=None)
    lone["nodes"] = lone["nodes"][:1]
    c = correction(lone, path)
    assert c["distance"] > c["radius"] > 0  # one node, where the training graphs have 8 to 30: outside them
    assert c["source"] == (f"none: the step lies outside the graph network's training data (its descriptor "
                           f"{c['distance']:.2f} from the nearest training step's; no training step lies farther "
                           f"than {c['radius']:.2f} from its nearest)")
    assert (c["alpha"], c["beta"]) == (1.0, 1.0)


def test_the_ensemble_averages_its_members(tmp_path):
    """Member k trains exactly as a lone network from seed + k would; the ensemble's log alpha and log beta are
    their means."""
    def lone(seed, members):
        out = tmp_path / f"s{seed}m{members}.gcw"
        info = train(tmp_path, out, "--seed", str(seed), "--members", str(members), "--epochs", "4", "--patience",
                     "100", train_graphs=48, val_graphs=16)
        assert info["epochs"] == 4
        return out
    a, b, both = lone(0, 1), lone(1, 1), lone(0, 2)
    for g in synthetic(6, 5):
        ca, cb, cab = correction(g, a), correction(g, b), correction(g, both)
        assert ca["alpha"] != cb["alpha"]
        assert math.log(cab["alpha"]) == pytest.approx((math.log(ca["alpha"]) + math.log(cb["alpha"])) / 2, abs=1e-6)
        assert math.log(cab["beta"]) == pytest.approx((math.log(ca["beta"]) + math.log(cb["beta"])) / 2, abs=1e-6)


def header(path):
    b = Path(path).read_bytes()
    n = int.from_bytes(b[12:16], "little")
    return json.loads(b[16:16 + n])


def test_recordings_of_one_case_count_as_one_case(tmp_path):
    # The dataset holds each case measured on two days: the same family, model, batch, threads, world, optimizer
    # and strategy (the measured step and the device rates differ). The radius is measured to the nearest graph of
    # another case; with every case recorded twice, nearest-other would be the twin and the radius about 0.
    a, b = two_graphs(8, 32)
    again = [dict(g, measured_ms=g["measured_ms"] * 1.05) for g in (a, b)]
    t, v = write_jsonl(tmp_path / "t.jsonl", [a, again[0]]), write_jsonl(tmp_path / "v.jsonl", [b, again[1]])
    out = tmp_path / "twice.gcw"
    args = ["--train", str(t), "--val", str(v), "--threads", "1", "--epochs", "2"]
    r = subprocess.run([str(TRAIN), "step-gnn", *args, "--out", str(out)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["applicability_radius"] == pytest.approx(2.0, abs=1e-5)
    # Without model names every graph is a case of its own: each lies 0 from its twin.
    for path, graphs in ((t, [a, again[0]]), (v, [b, again[1]])):
        write_jsonl(path, [{k: x for k, x in g.items() if k != "model"} for g in graphs])
    r = subprocess.run([str(TRAIN), "step-gnn", *args, "--out", str(tmp_path / "unnamed.gcw")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["applicability_radius"] == pytest.approx(0.0, abs=1e-5)
    # Rotated validation holds out whole cases: 20 cases recorded twice, a tenth of the cases (2, 4 graphs) each.
    cases = synthetic(5, 20)
    twice = [g for c in cases for g in (c, dict(c, measured_ms=c["measured_ms"] * 0.97))]
    t, v = write_jsonl(tmp_path / "t.jsonl", twice[:32]), write_jsonl(tmp_path / "v.jsonl", twice[32:])
    out = tmp_path / "rotated.gcw"
    r = subprocess.run([str(TRAIN), "step-gnn", "--train", str(t), "--val", str(v), "--out", str(out), "--threads",
                        "1", "--members", "10", "--rotate-val", "--epochs", "2", "--patience", "100"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert [m["val_graphs"] for m in header(out)["trained"]["members"]] == [4] * 10


def test_device_rates_measured_on_one_machine_are_not_read_as_another_machine(tmp_path):
    # Two recordings on one machine measured its matmul rate at 100 and 110 GFLOP/s and its copy at 76 and 87 GB/s:
    # standardised over them, a process measuring 115 would lie several deviations away. The rates' deviation is
    # taken as at least ln(2)/2; the other features keep theirs.
    graphs = []
    for i, g in enumerate(synthetic(6, 12)):
        peak, bw = (100.0, 76.0) if i % 2 else (110.0, 87.0)
        graphs.append(dict(g, **{"global": dict(g["global"], peak_gflops=peak, mem_gbps=bw)}))
    t, v = write_jsonl(tmp_path / "t.jsonl", graphs[:10]), write_jsonl(tmp_path / "v.jsonl", graphs[10:])
    out = tmp_path / "rates.gcw"
    r = subprocess.run([str(TRAIN), "step-gnn", "--train", str(t), "--val", str(v), "--out", str(out), "--threads",
                        "1", "--epochs", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    h = header(out)
    names = h["global_features"]
    for name, lo, hi in (("log_peak_gflops", 100.0, 110.0), ("log_mem_gbps", 76.0, 87.0)):
        j = names.index(name)
        assert h["global_std"][j] == pytest.approx(math.log(2) / 2, rel=1e-6)  # measured: ln(hi/lo)/2, below it
        assert math.log(hi / lo) / 2 < math.log(2) / 2
        assert h["applicability"]["std"][j] == pytest.approx(math.log(2) / 2, rel=1e-6)
    j = names.index("log_batch")  # standardised over the training graphs (without --rotate-val)
    batches = [math.log(g["global"]["batch"]) for g in graphs[:10]]
    mean = sum(batches) / len(batches)
    assert h["global_std"][j] == pytest.approx(math.sqrt(sum((b - mean) ** 2 for b in batches) / len(batches)),
                                               rel=1e-5)


def test_rotated_validation_holds_out_each_graph_once(tmp_path):
    out = tmp_path / "r.gcw"
    info = train(tmp_path, out, "--seed", "3", "--members", "10", "--rotate-val", "--epochs", "2", "--patience", "100",
                 train_graphs=48, val_graphs=16)
    h = header(out)
    assert h["members"] == 10 and h["trained"]["rotate_val"] is True
    members = h["trained"]["members"]
    assert [m["seed"] for m in members] == list(range(3, 13))
    assert [m["val_graphs"] for m in members] == [6, 6, 7, 6, 7, 6, 6, 7, 6, 7]  # tenths of 64 graphs
    assert all(m["train_graphs"] + m["val_graphs"] == 64 for m in members)
    # The reported validation loss is each member's on the graphs it held out.
    assert info["val_mse_log"] == pytest.approx(sum(m["val_mse_log"] * m["val_graphs"] for m in members) / 64)
    assert correction(GRAPH, out)["source"] == "gnn"


def test_training_is_deterministic(tmp_path):
    outs = []
    for k in range(2):
        info = train(tmp_path, tmp_path / f"w{k}.gcw", "--seed", "7", "--epochs", "3", "--patience", "100",
                     train_graphs=48, val_graphs=16)
        assert info["epochs"] == 3
        outs.append((tmp_path / f"w{k}.gcw").read_bytes())
    assert outs[0] == outs[1]


GRAPH = synthetic(5, 1)[0]


def fallback_source(path):
    c = correction(GRAPH, path)
    assert (c["alpha"], c["beta"]) == (1.0, 1.0)
    assert c["step_ms"] == pytest.approx(GRAPH["sum_layers_ms"] + GRAPH["comm_ms"])
    return c["source"]


def test_missing_weights_fall_back(tmp_path):
    p = tmp_path / "nope.gcw"
    assert fallback_source(p) == f"none: cannot open weights file '{p}': No such file or directory"


def test_truncated_weights_fall_back(trained, tmp_path):
    b = trained[0].read_bytes()
    p = tmp_path / "w.gcw"
    p.write_bytes(b[:len(b) // 2])
    assert fallback_source(p) == (f"none: weights file '{p}' is corrupt or truncated: its checksum does not match "
                                  f"its {len(b) // 2} bytes; retrain with gpucast-train or reinstall gpucast to get "
                                  "the shipped weights")


def test_other_versions_and_models_fall_back(trained, tmp_path):
    v2 = tmp_path / "v2.gcw"
    rewrite_weights_header(trained[0], v2, model_version=2)
    assert fallback_source(v2) == f"none: weights file '{v2}' holds model version 2; this gpucast reads version 3{FIX}"
    other = tmp_path / "other.gcw"
    rewrite_weights_header(trained[0], other, model="bigru-transformer")
    assert fallback_source(other) == (f"none: weights file '{other}' holds model \"bigru-transformer\", expected "
                                      f"\"scaledl-gnn\"{FIX}")
    none = tmp_path / "none.gcw"
    rewrite_weights_header(trained[0], none, members=0)
    assert fallback_source(none) == f"none: weights file '{none}': members is 0, expected 1 to 32{FIX}"
    fewer = tmp_path / "fewer.gcw"
    rewrite_weights_header(trained[0], fewer, members=4)  # the file holds 5 networks' tensors
    assert fallback_source(fewer).startswith(f"none: weights file '{fewer}' has ")
    narrow = tmp_path / "narrow.gcw"
    rewrite_weights_header(trained[0], narrow, node_mean=[0.0] * 3)
    assert fallback_source(narrow) == (f"none: weights file '{narrow}': node normalisation has 3/11 values, expected "
                                       f"11{FIX}")
    reach = header(trained[0])["applicability"]
    odd = tmp_path / "odd.gcw"
    rewrite_weights_header(trained[0], odd, applicability=dict(reach, points=reach["points"][:-1]))
    assert fallback_source(odd) == (f"none: weights file '{odd}': applicability points hold {len(reach['points']) - 1} "
                                    f"values, expected a positive multiple of 28, all finite{FIX}")
    far = tmp_path / "far.gcw"
    rewrite_weights_header(trained[0], far, applicability=dict(reach, radius=-2.5))
    assert fallback_source(far) == (f"none: weights file '{far}': applicability radius is -2.5, expected at least 0, "
                                    f"or -1 for no limit{FIX}")
    bare = tmp_path / "bare.gcw"
    rewrite_weights_header(trained[0], bare, applicability=None)
    assert fallback_source(bare) == (f"none: weights file '{bare}': applicability: expected an object with number "
                                     f"lists \"mean\", \"std\" and \"points\", a number \"radius\" and optionally "
                                     f"a list of integers \"batches\" ([json.exception.type_error.304] cannot use at() "
                                     f"with null){FIX}")
    # The training graphs' batch sizes (what correct_step_time reads the valid range from): the trainer writes the
    # sorted distinct batches of every graph it saw, and a file with other values is refused.
    assert reach["batches"] == [8, 16, 32]
    unsorted = tmp_path / "unsorted.gcw"
    rewrite_weights_header(trained[0], unsorted, applicability=dict(reach, batches=[32, 8]))
    assert fallback_source(unsorted) == (f"none: weights file '{unsorted}': applicability batches should be at most "
                                         f"4096 ascending batch sizes of 1 to 2^30{FIX}")


def two_graphs(batch_a, batch_b):
    """Two graphs that differ in their batch only: in the network's descriptors, only log batch differs."""
    g = synthetic(8, 1)[0]
    g["global"] = dict(g["global"], world=1, strategy="single")
    g["comm_ms"] = 0.0
    return [dict(g, **{"global": dict(g["global"], batch=b)}) for b in (batch_a, batch_b)]


def test_graphs_outside_the_training_data_get_no_correction(tmp_path):
    # Trained on two graphs that differ only in batch (8 and 32): standardised over them, log batch is -1 and +1
    # and every other descriptor 0, so each lies 2 from the other: the radius is 2. A batch of 16 lies 1 from
    # both; 128 lies at (log 128 - log 16) / log 2 = 3 from the mean, 2 from the nearest (32): inside, at the
    # radius; 256 lies 3 from 32: outside.
    a, b = two_graphs(8, 32)
    t, v = write_jsonl(tmp_path / "t.jsonl", [a]), write_jsonl(tmp_path / "v.jsonl", [b])
    out = tmp_path / "two.gcw"
    r = subprocess.run([str(TRAIN), "step-gnn", "--train", str(t), "--val", str(v), "--out", str(out), "--threads",
                        "1", "--epochs", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["applicability_radius"] == pytest.approx(2.0, abs=1e-5)
    assert header(out)["applicability"]["radius"] == pytest.approx(2.0, abs=1e-5)
    for batch, distance, inside in ((8, 0.0, True), (16, 1.0, True), (32, 0.0, True), (128, 2.0, True),
                                    (256, 3.0, False)):
        g = dict(a, **{"global": dict(a["global"], batch=batch)})
        c = correction(g, out)
        assert c["distance"] == pytest.approx(distance, abs=1e-4) and c["radius"] == pytest.approx(2.0, abs=1e-5)
        if inside:
            assert c["source"] == "gnn", (batch, c)
        else:
            assert c["source"] == ("none: the step lies outside the graph network's training data (its descriptor "
                                   "3.00 from the nearest training step's; no training step lies farther than 2.00 "
                                   "from its nearest)")
            assert (c["alpha"], c["beta"]) == (1.0, 1.0)


def test_fixed_file_is_read_again(trained, tmp_path):
    """The cache is keyed by modification time: a file repaired in place is loaded again."""
    p = tmp_path / "w.gcw"
    p.write_bytes(b"GPUCASTJ")
    assert fallback_source(p).startswith(f"none: weights file '{p}' is truncated")
    shutil.copyfile(trained[0], p)
    os.utime(p, ns=(1, 10**18))
    assert correction(GRAPH, p)["source"] == "gnn"


def test_default_weights():
    path = torch.ops.gpucast.step_gnn_weights_path()
    assert path.endswith(os.path.join("data", "step_gnn.gcw"))
    c = json.loads(torch.ops.gpucast.step_correction(json.dumps(GRAPH)))
    if os.path.exists(path):
        # The shipped network answers for the steps it was trained on (the cases of the default recordings that
        # are steady and agree between them, as bench/scaledl_compare.py --weights-out picks them) and declines a
        # synthetic graph unlike any.
        sys.path.insert(0, str(ROOT / "bench"))
        import scaledl_compare
        records = scaledl_compare.load(scaledl_compare.DATA)
        trained = scaledl_compare.reproducible(records, 0.10)
        assert (len(records), len(trained)) == (224, 164)
        keys = ("family", "model", "global", "nodes", "edges", "sum_layers_ms", "comm_ms", "measured_ms")
        for r in (trained[0], trained[-1]):
            known = json.loads(torch.ops.gpucast.step_correction(json.dumps({k: r[k] for k in keys})))
            assert known["source"] == "gnn" and known["distance"] == pytest.approx(0.0, abs=1e-4)
        assert c["source"].startswith("none: the step lies outside the graph network's training data")
    else:  # no shipped weights yet: the correction is the identity
        assert c == {"alpha": 1.0, "beta": 1.0, "source": f"none: cannot open weights file '{path}': No such file or "
                     "directory", "step_ms": pytest.approx(GRAPH["sum_layers_ms"] + GRAPH["comm_ms"])}


def test_environment_variable_names_the_weights(tmp_path):
    p = tmp_path / "nope.gcw"
    out = subprocess.run(
        [sys.executable, "-c", "import gpucast, torch; print(torch.ops.gpucast.step_gnn_weights_path())"],
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, GPUCAST_STEP_GNN_WEIGHTS=str(p), PYTHONPATH=f"{ROOT / 'python'}"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == str(p)


def bad(graph):
    with pytest.raises(ValueError) as e:
        torch.ops.gpucast.step_correction(graph if isinstance(graph, str) else json.dumps(graph), "")
    assert error_code(e.value) == "step-graph"
    return str(e.value).splitlines()[0].removeprefix("[gpucast:step-graph] ")


def test_bad_graphs_are_value_errors():
    g = json.loads(json.dumps(GRAPH))
    n = len(g["nodes"])
    assert bad("{\"nodes\": [").startswith("graph: malformed JSON at byte 12: ")
    assert bad([1]) == "graph: expected a JSON object (one step graph), got array"
    assert bad(dict(g, edges=g["edges"][:2] + [[n + 3, 0, 1.0]])) == (
        f"graph: edges[2]: src {n + 3} is not a node ({n} nodes)")
    assert bad(dict(g, edges=[[0, -1, 1.0]])) == f"graph: edges[0]: dst -1 is not a node ({n} nodes)"
    assert bad(dict(g, edges=[[1, 1, 1.0]])) == (
        "graph: edges[0]: src and dst are both 1; a layer does not feed itself (self-loops are implied)")
    assert bad(dict(g, edges=[[0, 1]])) == "graph: edges[0]: expected [src, dst, bytes], got [0,1]"
    assert bad(dict(g, nodes=[dict(g["nodes"][0], kind="lstm")], edges=[])) == (
        "graph: nodes[0].kind: \"lstm\" is not a known kind; known kinds: \"matmul\", \"conv\", \"attention\", "
        "\"norm\", \"embedding\", \"pool\", \"elementwise\", \"other\" (write \"other\" for any other)")
    assert bad(dict(g, nodes=[dict(g["nodes"][0], flops=-5)], edges=[])) == (
        "graph: nodes[0].flops: expected a finite number >= 0, got -5")
    assert bad(dict(g, nodes=[], edges=[])) == "graph: nodes: empty; a step graph needs at least one layer"
    assert bad(dict(g, **{"global": dict(g["global"], optimizer="lamb")})) == (
        "graph: global.optimizer: \"lamb\" is not a known optimizer; known optimizers: \"sgd\", \"adam\", \"adamw\", "
        "\"other\" (write \"other\" for any other)")
    assert bad(dict(g, **{"global": {k: v for k, v in g["global"].items() if k != "batch"}})) == (
        "graph: global.batch: missing (expected an integer >= 1)")
    assert bad(dict(g, **{"global": dict(g["global"], world=0)})) == (
        "graph: global.world: expected an integer >= 1, got 0")
    assert bad(dict(g, sum_layers_ms=0, comm_ms=0)) == (
        "graph: sum_layers_ms and comm_ms are both 0; the forecast scales them, so one must be > 0")
    assert bad(dict(g, measured_ms=-2)) == "graph: measured_ms: expected a finite number > 0, got -2"


def test_trainer_bad_input(tmp_path):
    def run(*args):
        return subprocess.run([str(TRAIN), "step-gnn", *args], capture_output=True, text=True, timeout=60)
    r = run("--train", "x.jsonl")
    assert r.returncode == 2 and r.stderr.startswith("gpucast-train step-gnn: --train, --val and --out are required")
    data = tmp_path / "d.jsonl"
    g = synthetic(6, 3)
    write_jsonl(data, [g[0], dict(g[1], measured_ms=None)])
    r = run("--train", str(data), "--val", str(data), "--out", str(tmp_path / "w.gcw"))
    assert r.returncode == 2
    assert r.stderr.strip() == f"{data}:2: measured_ms: missing; training needs the measured time"
    write_jsonl(data, [g[0], g[1], dict(g[2], edges=[[0, 1, 2.0], [1, 2, 2.0], [99, 0, 1.0]])])
    r = run("--train", str(data), "--val", str(data), "--out", str(tmp_path / "w.gcw"))
    assert r.returncode == 2
    assert r.stderr.strip() == f"{data}:3: edges[2]: src 99 is not a node ({len(g[2]['nodes'])} nodes)"
    assert not (tmp_path / "w.gcw").exists()
    write_jsonl(data, g)
    r = run("--train", str(data), "--val", str(data), "--out", str(tmp_path / "w.gcw"), "--members", "0")
    assert r.returncode == 2 and r.stderr.strip() == "gpucast-train step-gnn: --members expects 1 to 32, got 0"
    assert not (tmp_path / "w.gcw").exists()
    # The job model's command line is unchanged.
    r = subprocess.run([str(TRAIN), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("usage: gpucast-train --train FILE --val FILE --out WEIGHTS")
    r = run("--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: gpucast-train step-gnn --train FILE")


def test_the_dataset_recorder_writes_what_the_training_reads(tmp_path):
    """bench/step_dataset.py on one small case, as the shipped network's data is recorded: it must not rot between
    recordings (it once imported a measurement helper the accuracy bench had renamed), and its line must be a step
    graph the network accepts."""
    out = tmp_path / "one.jsonl.gz"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "step_dataset.py"), "--out", str(out), "--only",
                        "zoo_mlp", "--batches", "16", "--optimizers", "sgd", "--iterations", "4"],
                       env=dict(os.environ, PYTHONPATH=f"{ROOT / 'python'}:{ROOT}"), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-1])["cases"] == 1
    with gzip.open(out, "rt") as f:
        (row,) = [json.loads(line) for line in f]
    assert (row["family"], row["model"], row["batch"], row["optimizer"]) == ("zoo_mlp", "mlp", 16, "sgd")
    assert [p["batch"] for p in row["probes"]] == [2, 4, 8] and len(row["timings"]) == 3
    assert len(row["nodes"]) == len(row["probes"][0]["layers"]) > 0
    assert row["measured_ms"] > 0 and row["measured_iqr_ms"] >= 0
    keys = ("family", "model", "global", "nodes", "edges", "sum_layers_ms", "comm_ms", "measured_ms")
    assert row["timing_rounds"] == 3 and row["first_round_sum_layers_ms"] > 0  # the forecast's three rounds
    got = json.loads(torch.ops.gpucast.step_correction(json.dumps({k: row[k] for k in keys}), ""))
    # The shipped network reads the line as a step graph: it corrects it, or declines it as outside its data.
    assert got["source"] == "gnn" or got["source"].startswith("none: the step lies outside"), got
    assert got["step_ms"] == pytest.approx(got["alpha"] * row["sum_layers_ms"] + got["beta"] * row["comm_ms"])
