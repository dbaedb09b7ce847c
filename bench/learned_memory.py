"""Job-level memory prediction: gpucast's BiGRU-optimized Transformer against Decision Tree, Random Forest,
AdaBoost and XGBoost and the analytical estimate, on two datasets:

  GPU jobs (bench/dataset/gpu_jobs.jsonl.gz, bench/dataset/gpu_jobs.py): transformers decoders, encoders, ViTs and
    torchvision CNNs from 10 M to 70 B parameters over 1 to 512 GPUs, each row one rank's peak allocated and reserved
    bytes on H100-80GB, A100-80GB or L4 as gpucast's trace forecast gives it (label_source forecast-gpu); the rows
    of one group share its probes, so groups are never split between training and test.
  CPU jobs (bench/dataset/jobs.jsonl.gz, bench/dataset/generate.py): small jobs measured on this machine's CPU
    allocator (label_source measured-cpu; forecast-cpu where a run was too slow and the CPU trace forecast labels
    it); allocated bytes only.
  Measured GPU jobs (bench/results/gpu/memory_accuracy.txt): the zoo's jobs measured on a real GPU (label_source
    measured-gpu), scored with the in-domain model beside the trace forecast of the same run; never trained on.

One model answers both. Splits (fixed seed):
  in-domain      GPU groups and CPU jobs each random 70 / 15 / 15 (train / validation / test), trained together;
                 scored on the GPU test rows and on the CPU test jobs apart
  out-of-domain  (unless --no-ood) GPU held-out families ({gpt2, vit}, {qwen2, bert}: trained on the rest of the GPU
                 groups and every CPU job), GPU held-out sizes (trained on groups up to 13 B parameters, tested on
                 those of 30 B and more: the learned answer is scored even where it is flagged out of range), and
                 the CPU family folds {mlp, vit}, {cnn, transformer-decoder}, {rnn, transformer-encoder} (trained on
                 the other CPU families and every GPU group); each fold's test rows pooled per split.
Every learned model is tuned on the validation split only (baselines: a grid of hyperparameters, the one with the
lowest validation MSE on bytes; BiGRU-Transformer: early stopping on the validation loss, the mean relative error).
Baselines read the same job features as the BiGRU-Transformer (torch.ops.gpucast.job_features), the layer sequence
flattened into aggregates per layer kind. The analytical estimate (predictor/job.cpp) is scored beside them, and on
the CPU split the trace-based forecast where a job has both a forecast and a measured label.

Errors are computed on bytes. Inference time: torch.ops.gpucast.predict_job per job (JSON in, JSON out), over the
in-domain test rows, one thread. Last line: one JSON object.

--ship writes the in-domain model's weights to predictor/weights/job_memory.gcw (the weights gpucast ships).
"""
from __future__ import annotations

import argparse
import gzip
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]

KINDS = ["linear", "conv", "norm", "embedding", "attention", "rnn", "activation", "pool", "dropout", "other"]
OOD_FOLDS = [("mlp", "vit"), ("cnn", "transformer-decoder"), ("rnn", "transformer-encoder")]
LEARNED = ["BiGRU-Transformer", "DecisionTree", "RandomForest", "AdaBoost", "XGBoost"]


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def features(rows: list[dict]) -> np.ndarray:
    """Job features plus per-kind aggregates of the layer features (same numbers the BiGRU-Transformer reads)."""
    import torch
    import gpucast  # noqa: F401 - loads the ops
    out = []
    for r in rows:
        f = json.loads(torch.ops.gpucast.job_features(json.dumps(r["job"])))
        names = f["layer_names"]
        lay = np.array(f["layers"], dtype=np.float64)
        i_par, i_act, i_micro = names.index("log_params"), names.index("log_act_per_sample"), \
            names.index("log_act_micro_batch")
        agg = []
        for k in range(len(KINDS)):
            sel = lay[lay[:, k] == 1.0]
            agg += [np.log1p(len(sel)),
                    np.log1p(np.expm1(sel[:, i_par]).sum()) if len(sel) else 0.0,
                    np.log1p(np.expm1(sel[:, i_micro]).sum()) if len(sel) else 0.0,
                    sel[:, i_micro].max() if len(sel) else 0.0,
                    np.log1p(np.expm1(sel[:, i_act]).sum()) if len(sel) else 0.0]
        out.append(np.array(f["job"] + agg, dtype=np.float64))
    return np.stack(out)


def metrics(pred, y) -> dict:
    pred = np.asarray(pred, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    err = pred - y
    mse = float(np.mean(err ** 2))
    return {"mse": mse, "rmse": float(np.sqrt(mse)), "mae": float(np.mean(np.abs(err))),
            "r2": float(1.0 - np.sum(err ** 2) / np.sum((y - y.mean()) ** 2)),
            "mre_pct": float(100.0 * np.mean(np.abs(err) / y)), "n": int(len(y))}


def baseline_grid(name: str, seed: int):
    from sklearn.ensemble import AdaBoostRegressor, RandomForestRegressor
    from sklearn.tree import DecisionTreeRegressor
    from xgboost import XGBRegressor
    if name == "DecisionTree":
        for d, leaf in itertools.product([4, 6, 8, 12, 16, None], [1, 3, 10]):
            yield {"max_depth": d, "min_samples_leaf": leaf}, lambda d=d, leaf=leaf: DecisionTreeRegressor(
                max_depth=d, min_samples_leaf=leaf, random_state=seed)
    elif name == "RandomForest":
        for n, feat, d in itertools.product([300], [1.0, 0.5, 0.33], [None, 16]):
            yield {"n_estimators": n, "max_features": feat, "max_depth": d}, \
                lambda n=n, feat=feat, d=d: RandomForestRegressor(n_estimators=n, max_features=feat, max_depth=d,
                                                                  random_state=seed, n_jobs=2)
    elif name == "AdaBoost":
        for depth, n, lr in itertools.product([4, 8, 12], [100, 300], [0.1, 1.0]):
            yield {"base_depth": depth, "n_estimators": n, "learning_rate": lr}, \
                lambda depth=depth, n=n, lr=lr: AdaBoostRegressor(DecisionTreeRegressor(max_depth=depth),
                                                                  n_estimators=n, learning_rate=lr,
                                                                  random_state=seed)
    elif name == "XGBoost":
        for depth, n, lr in itertools.product([3, 6, 9], [300, 1000], [0.03, 0.1]):
            yield {"max_depth": depth, "n_estimators": n, "learning_rate": lr}, \
                lambda depth=depth, n=n, lr=lr: XGBRegressor(max_depth=depth, n_estimators=n, learning_rate=lr,
                                                             subsample=0.9, colsample_bytree=0.9, random_state=seed,
                                                             n_jobs=2, tree_method="hist")


def fit_baseline(name, Xtr, ytr, Xva, yva, seed):
    """The grid point (and target: log-bytes or bytes) with the lowest validation MSE on bytes."""
    best = None
    for params, make in baseline_grid(name, seed):
        for target in ("log", "bytes"):
            m = make()
            m.fit(Xtr, np.log(ytr) if target == "log" else ytr)
            p = m.predict(Xva)
            p = np.exp(p) if target == "log" else p
            mse = float(np.mean((p - yva) ** 2))
            if best is None or mse < best[0]:
                best = (mse, dict(params, target=target), m)
    return best


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({"job": r["job"], "label_bytes": r["label_bytes"],
                                "label_reserved_bytes": r.get("label_reserved_bytes")}) + "\n")


def train_bigru(train, val, out: Path, seed: int, args) -> dict:
    exe = ROOT / args.build / "bin" / "gpucast-train"
    if not exe.exists():
        raise SystemExit(f"learned_memory: {exe} not found; run `make build` first")
    with tempfile.TemporaryDirectory() as d:
        write_jsonl(Path(d) / "train.jsonl", train)
        write_jsonl(Path(d) / "val.jsonl", val)
        cmd = [str(exe), "--train", f"{d}/train.jsonl", "--val", f"{d}/val.jsonl", "--out", str(out), "--seed",
               str(seed), "--epochs", str(args.epochs), "--patience", str(args.patience), "--threads",
               str(args.threads)]
        if args.lr:
            cmd += ["--lr", str(args.lr)]
        if args.verbose:
            cmd.append("--verbose")
        # stdout (the result line) is always read; stderr (the epochs with --verbose) goes to the terminal.
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None if args.verbose else subprocess.PIPE, text=True)
        if res.returncode != 0:
            raise SystemExit(f"gpucast-train failed: {res.stderr}")
        return json.loads((res.stdout or "").strip().splitlines()[-1]) if res.stdout else {}


def predict_jobs(rows, weights: Path | None) -> tuple[np.ndarray, np.ndarray, list[float], int]:
    """Allocated and reserved bytes (NaN where not estimated), ms per call, and how many answers were flagged
    out of range; weights None: the analytical estimate."""
    import torch
    import gpucast  # noqa: F401
    alloc, reserved, times, flagged = [], [], [], 0
    for r in rows:
        text = json.dumps(r["job"])
        t0 = time.perf_counter()
        e = json.loads(torch.ops.gpucast.predict_job(text, str(weights) if weights else "/nonexistent.gcw"))
        times.append((time.perf_counter() - t0) * 1e3)
        if weights and e["method"] != "learned":
            raise SystemExit(f"learned_memory: the learned model did not answer: {e['notes'][:1]}")
        alloc.append(e["bytes"])
        reserved.append(np.nan if e["reserved_bytes"] is None else e["reserved_bytes"])
        flagged += bool(e["out_of_range"])
    return np.array(alloc, dtype=np.float64), np.array(reserved, dtype=np.float64), times, flagged


def evaluate(fold: str, train, val, tests: dict, seed, args, workdir: Path, results: list, extra: dict):
    """Trains every model on `train` (tuned on `val`) and scores it on each test set of `tests` ({split: rows})."""
    weights = workdir / f"bigru_{len(extra.get('bigru_training', []))}.gcw"
    t0 = time.perf_counter()
    info = train_bigru(train, val, weights, seed, args)
    extra.setdefault("bigru_training", []).append(dict(info, fold=fold, wall_s=round(time.perf_counter() - t0, 1)))
    if fold == "in-domain":
        extra["weights"] = weights
    for split, test in tests.items():
        if not test:
            continue
        y = np.array([r["label_bytes"] for r in test], dtype=np.float64)
        alloc, reserved, times, flagged = predict_jobs(test, weights)
        results.append(("BiGRU-Transformer", split, "allocated", alloc, y, {"out_of_range": flagged}))
        known = np.array([r.get("label_reserved_bytes") or 0 for r in test], dtype=np.float64)
        if (known > 0).any():
            results.append(("BiGRU-Transformer", split, "reserved", reserved[known > 0], known[known > 0], {}))
        if fold == "in-domain":
            extra.setdefault("inference_ms", []).extend(times)
        analytic, _, _, _ = predict_jobs(test, None)
        results.append(("analytical", split, "allocated", analytic, y, {}))
        if split.startswith("cpu"):
            both = [r for r in test if r.get("measured_bytes") is not None and r.get("forecast_bytes") is not None]
            if both:
                results.append(("trace-forecast", split, "allocated",
                                np.array([r["forecast_bytes"] for r in both], dtype=np.float64),
                                np.array([r["measured_bytes"] for r in both], dtype=np.float64), {}))
    if args.skip_baselines:
        return
    Xtr, Xva = features(train), features(val)
    ytr = np.array([r["label_bytes"] for r in train], dtype=np.float64)
    yva = np.array([r["label_bytes"] for r in val], dtype=np.float64)
    for name in LEARNED[1:]:
        _, params, m = fit_baseline(name, Xtr, ytr, Xva, yva, seed)
        for split, test in tests.items():
            if test:
                p = m.predict(features(test))
                results.append((name, split, "allocated", np.exp(p) if params["target"] == "log" else p,
                                np.array([r["label_bytes"] for r in test], dtype=np.float64), params))


def load_cpu(path: Path) -> list[dict]:
    rows = load(path)
    for r in rows:  # the dataset's own words for its labels, as the GPU rows say theirs
        r["label_source"] = {"measured": "measured-cpu", "forecast": "forecast-cpu"}.get(r["label_source"],
                                                                                        r["label_source"])
    return rows


def load_gpu(path: Path) -> list[dict]:
    sys.path.insert(0, str(ROOT / "bench" / "dataset"))
    import gpu_jobs
    return gpu_jobs.training_rows(gpu_jobs.read_groups(path))


def load_measured_gpu() -> list[dict]:
    """The GPU runs measured on a real GPU (bench/results/gpu/memory_accuracy.txt: the zoo's jobs with AdamW, peaks
    of torch.cuda.max_memory_allocated / _reserved), each described by gpucast.describe on the CPU at its batch and
    target (label_source measured-gpu), with the trace forecast's answer from the same run."""
    path = ROOT / "bench/results/gpu/memory_accuracy.txt"
    if not path.exists():
        return []
    import torch
    import gpucast
    from examples import zoo
    run = json.loads([line for line in path.read_text().splitlines() if line.startswith("{")][-1])
    known = {**zoo.CASES, **zoo.real_cases()}  # as memory_accuracy.py builds its cases
    out = []
    for c in run["cases"]:
        case = known[c["case"]]
        torch.manual_seed(0)
        model = case.make_model()
        job = gpucast.describe(model, case.make_batch, c["batch"], loss_fn=case.loss_fn,
                               optimizer=zoo.make_optimizer("adamw", model.parameters()))
        job["target"] = run["target"]
        out.append({"job": job, "label_bytes": c["measured_allocated"],
                    "label_reserved_bytes": c["measured_reserved"], "label_source": "measured-gpu",
                    "family": job["family"], "case": c["case"], "forecast_bytes": c["forecast_allocated"],
                    "forecast_reserved_bytes": c["forecast_reserved"]})
    return out


def score_measured_gpu(rows: list[dict], weights: Path, results: list) -> None:
    """The shipped-to-be model and the trace forecast against the measured GPU rows, allocated and reserved."""
    if not rows:
        return
    alloc, reserved, _, flagged = predict_jobs(rows, weights)
    y = np.array([r["label_bytes"] for r in rows], dtype=np.float64)
    yr = np.array([r["label_reserved_bytes"] for r in rows], dtype=np.float64)
    results.append(("BiGRU-Transformer", "gpu measured", "allocated", alloc, y, {"out_of_range": flagged}))
    results.append(("BiGRU-Transformer", "gpu measured", "reserved", reserved, yr, {}))
    analytic, _, _, _ = predict_jobs(rows, None)
    results.append(("analytical", "gpu measured", "allocated", analytic, y, {}))
    results.append(("trace-forecast", "gpu measured", "allocated",
                    np.array([r["forecast_bytes"] for r in rows], dtype=np.float64), y, {}))
    results.append(("trace-forecast", "gpu measured", "reserved",
                    np.array([r["forecast_reserved_bytes"] for r in rows], dtype=np.float64), yr, {}))
    for r, a, b in zip(rows, alloc, reserved):
        print(f"measured on the GPU: {r['case']:<9} allocated {r['label_bytes'] / 2**20:8.1f} MiB, learned "
              f"{a / 2**20:8.1f} ({100 * (a / r['label_bytes'] - 1):+.1f} %), trace forecast "
              f"{r['forecast_bytes'] / 2**20:8.1f} ({100 * (r['forecast_bytes'] / r['label_bytes'] - 1):+.2f} %); "
              f"reserved {r['label_reserved_bytes'] / 2**20:8.1f}, learned {b / 2**20:8.1f} "
              f"({100 * (b / r['label_reserved_bytes'] - 1):+.1f} %)")


def split3(items: list, rng) -> tuple[list, list, list]:
    perm = [items[i] for i in rng.permutation(len(items))]
    a, b = int(0.70 * len(perm)), int(0.85 * len(perm))
    return perm[:a], perm[a:b], perm[b:]


def gpu_fold(gpu: list[dict], train_groups, val_groups) -> tuple[list, list]:
    return [r for r in gpu if r["group"] in train_groups], [r for r in gpu if r["group"] in val_groups]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(ROOT / "bench/dataset/jobs.jsonl.gz"), help="the CPU jobs")
    ap.add_argument("--gpu-data", default=str(ROOT / "bench/dataset/gpu_jobs.jsonl.gz"), help="the GPU jobs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--patience", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=None, help="the BiGRU-Transformer's learning rate (gpucast-train's "
                                                            "default without it)")
    ap.add_argument("--build", default="build", help="CMake build directory holding bin/gpucast-train")
    ap.add_argument("--no-ood", action="store_true", help="in-domain split only")
    ap.add_argument("--skip-baselines", action="store_true")
    ap.add_argument("--ship", action="store_true",
                    help="copy the in-domain model's weights to predictor/weights/job_memory.gcw")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    cpu = load_cpu(Path(args.data))
    gpu = load_gpu(Path(args.gpu_data)) if Path(args.gpu_data).exists() else []
    for name, rows in (("CPU", cpu), ("GPU", gpu)):
        if rows:
            y = np.array([r["label_bytes"] for r in rows], dtype=np.float64)
            src = {s: sum(1 for r in rows if r["label_source"] == s) for s in sorted({r["label_source"] for r in rows})}
            print(f"{name} jobs: {len(rows)} ({', '.join(f'{v} {k}' for k, v in src.items())}), allocated peaks "
                  f"{y.min() / 2**20:.2f} MiB to {y.max() / 2**30:.2f} GiB (median {np.median(y) / 2**20:.1f} MiB)")
    if gpu:
        params = np.array([r["params"] for r in gpu], dtype=np.float64)
        print(f"GPU jobs: {len({r['group'] for r in gpu})} groups, {params.min() / 1e6:.0f} M to "
              f"{params.max() / 1e9:.1f} B parameters, {len({r['job']['world_size'] for r in gpu})} world sizes up to "
              f"{max(r['job']['world_size'] for r in gpu)}")
    rng = np.random.default_rng(args.seed)
    results: list = []
    extra: dict = {}
    cpu_tr, cpu_va, cpu_te = split3(cpu, rng)
    groups = sorted({r["group"] for r in gpu})
    g_tr, g_va, g_te = (set(x) for x in split3(groups, rng))
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        gtr, gva = gpu_fold(gpu, g_tr, g_va)
        evaluate("in-domain", cpu_tr + gtr, cpu_va + gva,
                 {"gpu in-domain": [r for r in gpu if r["group"] in g_te], "cpu in-domain": cpu_te},
                 args.seed, args, work, results, extra)
        score_measured_gpu(load_measured_gpu(), extra["weights"], results)
        if args.ship:
            dst = ROOT / "predictor/weights/job_memory.gcw"
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(extra["weights"], dst)
            print(f"shipped weights: {dst.relative_to(ROOT)}")
        if not args.no_ood:
            cpu_tr_all, cpu_va_all = cpu[:int(0.85 * len(cpu))], cpu[int(0.85 * len(cpu)):]
            for fold in (("gpt2", "vit"), ("qwen2", "bert")):
                inside = [g for g in groups if all(r["family"] not in fold for r in gpu if r["group"] == g)]
                held = [r for r in gpu if r["family"] in fold]
                k = int(0.85 * len(inside))
                tr, va = gpu_fold(gpu, set(inside[:k]), set(inside[k:]))
                evaluate(f"gpu families {fold}", cpu_tr_all + tr, cpu_va_all + va, {"gpu held-out families": held},
                         args.seed, args, work, results, extra)
            small = [g for g in groups if all(r["params"] <= 13e9 for r in gpu if r["group"] == g)]
            large = [r for r in gpu if r["params"] >= 30e9]
            k = int(0.85 * len(small))
            tr, va = gpu_fold(gpu, set(small[:k]), set(small[k:]))
            evaluate("gpu sizes", cpu_tr_all + tr, cpu_va_all + va, {"gpu held-out sizes": large}, args.seed, args,
                     work, results, extra)
            for fold in OOD_FOLDS:
                inside = [r for r in cpu if r["family"] not in fold]
                k = int(0.85 * len(inside))
                gtr, gva = gpu_fold(gpu, g_tr | g_te, g_va)
                evaluate(f"cpu families {fold}", inside[:k] + gtr, inside[k:] + gva,
                         {"cpu out-of-domain": [r for r in cpu if r["family"] in fold]}, args.seed, args, work,
                         results, extra)
    return report(results, extra, len(cpu), len(gpu))


def report(results: list, extra: dict, n_cpu: int, n_gpu: int) -> int:
    pooled: dict = {}
    for name, split, what, pred, y, params in results:
        p, t, ps = pooled.setdefault((name, split, what), ([], [], []))
        p.append(pred)
        t.append(y)
        ps.append(params)
    table = []
    print(f"\n{'model':<19} {'split':<24} {'bytes':<10} {'n':>6} {'MSE (GiB^2)':>13} {'RMSE MiB':>10} {'MAE MiB':>9} "
          f"{'R2':>7} {'MRE %':>7}")
    splits = ("gpu in-domain", "gpu held-out families", "gpu held-out sizes", "gpu measured", "cpu in-domain",
              "cpu out-of-domain")
    for split in splits:
        for what in ("allocated", "reserved"):
            for name in LEARNED + ["analytical", "trace-forecast"]:
                if (name, split, what) not in pooled:
                    continue
                p, t, ps = pooled[(name, split, what)]
                m = metrics(np.concatenate(p), np.concatenate(t))
                flagged = sum(x.get("out_of_range", 0) for x in ps)
                row = {"model": name, "split": split, "bytes": what,
                       **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in m.items()},
                       "out_of_range": flagged}
                table.append(row)
                print(f"{name:<19} {split:<24} {what:<10} {m['n']:>6} {m['mse'] / 2**60:>13.5f} "
                      f"{m['rmse'] / 2**20:>10.2f} {m['mae'] / 2**20:>9.2f} {m['r2']:>7.4f} {m['mre_pct']:>7.2f}"
                      f"{f'  ({flagged} flagged out of range)' if flagged else ''}")
    times = extra.get("inference_ms", [0.0])
    print(f"\nBiGRU-Transformer inference: median {statistics.median(times):.2f} ms per job, p95 "
          f"{np.percentile(times, 95):.2f} ms, max {max(times):.2f} ms (torch.ops.gpucast.predict_job, one thread, "
          f"{len(times)} jobs)")
    for t in extra.get("bigru_training", []):
        print(f"  training ({t['fold']}): {t.get('train_jobs')} jobs, best epoch {t.get('best_epoch')} of "
              f"{t.get('epochs')}, {t['wall_s']} s")
    print(json.dumps({"bench": "learned_memory", "cpu_jobs": n_cpu, "gpu_jobs": n_gpu,
                      "inference_ms_median": round(statistics.median(times), 3),
                      "inference_ms_p95": round(float(np.percentile(times, 95)), 3),
                      "rows": [{k: r[k] for k in ("model", "split", "bytes", "mse", "rmse", "mae", "r2", "mre_pct", "n",
                                                  "out_of_range")} for r in table]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
