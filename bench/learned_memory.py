"""Job-level memory prediction: gpucast's BiGRU-optimized Transformer against Decision Tree, Random Forest,
AdaBoost and XGBoost, and against gpucast's trace-based forecast, on the dataset of bench/dataset/.

Splits (fixed seed):
  in-domain      random 70 / 15 / 15 (train / validation / test) over every job
  out-of-domain  whole families held out, three folds: {mlp, vit}, {cnn, transformer-decoder},
                 {rnn, transformer-encoder}; each fold trains on the other four families (85 / 15 train /
                 validation) and is tested on every job of its two; the three folds' test jobs are pooled.
Every learned model is tuned on the validation split only (baselines: a grid of hyperparameters, the one with the
lowest validation MSE on bytes; BiGRU-Transformer: early stopping on validation loss). Baselines read the same
job features as the BiGRU-Transformer (torch.ops.gpucast.job_features), the layer sequence flattened into
aggregates per layer kind (count, summed parameters, summed and largest activation bytes of the micro-batch).
The trace-based forecast row covers the test jobs that have both a forecast and a measured label.

Labels are a CPU-memory proxy (peak CPU-allocator bytes of the training iteration) until GPU labels exist.
Errors are computed on bytes. Inference time: torch.ops.gpucast.predict_job per job (JSON in, JSON out), median
over the in-domain test jobs, one thread. Last line: one JSON object.

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
            f.write(json.dumps({"job": r["job"], "label_bytes": r["label_bytes"]}) + "\n")


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
        if args.verbose:
            cmd.append("--verbose")
        res = subprocess.run(cmd, capture_output=not args.verbose, text=True)
        if res.returncode != 0:
            raise SystemExit(f"gpucast-train failed: {res.stderr}")
        return json.loads((res.stdout or "").strip().splitlines()[-1]) if res.stdout else {}


def predict_bigru(rows, weights: Path) -> tuple[np.ndarray, list[float]]:
    import torch
    import gpucast  # noqa: F401
    preds, times = [], []
    for r in rows:
        text = json.dumps(r["job"])
        t0 = time.perf_counter()
        e = json.loads(torch.ops.gpucast.predict_job(text, str(weights)))
        times.append((time.perf_counter() - t0) * 1e3)
        if e["method"] != "learned":
            raise SystemExit(f"learned_memory: the learned model did not answer: {e['notes'][:1]}")
        preds.append(e["bytes"])
    return np.array(preds, dtype=np.float64), times


def evaluate(split: str, train, val, test, seed, args, workdir: Path, results: list, extra: dict):
    y_te = np.array([r["label_bytes"] for r in test], dtype=np.float64)
    weights = workdir / f"bigru_{split}_{len(results)}.gcw"
    t0 = time.perf_counter()
    info = train_bigru(train, val, weights, seed, args)
    extra.setdefault("bigru_training", []).append(dict(info, split=split, wall_s=round(time.perf_counter() - t0, 1)))
    pred, times = predict_bigru(test, weights)
    results.append(("BiGRU-Transformer", split, pred, y_te, {"epochs": info.get("epochs"),
                                                            "best_epoch": info.get("best_epoch")}))
    if split == "in-domain":
        extra["inference_ms_median"] = statistics.median(times)
        extra["inference_ms_p95"] = float(np.percentile(times, 95))
        extra["weights"] = weights
    Xtr, Xva, Xte = features(train), features(val), features(test)
    ytr = np.array([r["label_bytes"] for r in train], dtype=np.float64)
    yva = np.array([r["label_bytes"] for r in val], dtype=np.float64)
    for name in LEARNED[1:]:
        if args.skip_baselines:
            continue
        _, params, m = fit_baseline(name, Xtr, ytr, Xva, yva, seed)
        p = m.predict(Xte)
        results.append((name, split, np.exp(p) if params["target"] == "log" else p, y_te, params))
    both = [r for r in test if r["measured_bytes"] is not None and r["forecast_bytes"] is not None]
    if both:
        results.append(("trace-forecast", split, np.array([r["forecast_bytes"] for r in both], dtype=np.float64),
                        np.array([r["measured_bytes"] for r in both], dtype=np.float64), {}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(ROOT / "bench/dataset/jobs.jsonl.gz"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--patience", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--build", default="build", help="CMake build directory holding bin/gpucast-train")
    ap.add_argument("--no-ood", action="store_true", help="in-domain split only")
    ap.add_argument("--skip-baselines", action="store_true")
    ap.add_argument("--ship", action="store_true",
                    help="copy the in-domain model's weights to predictor/weights/job_memory.gcw")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    rows = load(Path(args.data))
    labels = np.array([r["label_bytes"] for r in rows], dtype=np.float64)
    sources = {s: sum(1 for r in rows if r["label_source"] == s) for s in ("measured", "forecast")}
    print(f"dataset: {len(rows)} jobs ({sources['measured']} measured, {sources['forecast']} forecast labels), "
          f"peaks {labels.min() / 2**20:.2f} MiB to {labels.max() / 2**30:.2f} GiB (median "
          f"{np.median(labels) / 2**20:.1f} MiB); CPU-memory proxy labels")
    rng = np.random.default_rng(args.seed)
    perm = rng.permutation(len(rows))
    n_tr, n_va = int(0.70 * len(rows)), int(0.15 * len(rows))
    results: list = []
    extra: dict = {}
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        tr = [rows[i] for i in perm[:n_tr]]
        va = [rows[i] for i in perm[n_tr:n_tr + n_va]]
        te = [rows[i] for i in perm[n_tr + n_va:]]
        evaluate("in-domain", tr, va, te, args.seed, args, work, results, extra)
        if args.ship:
            dst = ROOT / "predictor/weights/job_memory.gcw"
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(extra["weights"], dst)
            print(f"shipped weights: {dst.relative_to(ROOT)}")
        if not args.no_ood:
            for fold in OOD_FOLDS:
                inside = [rows[i] for i in perm if rows[i]["family"] not in fold]
                held = [rows[i] for i in perm if rows[i]["family"] in fold]
                k = int(0.85 * len(inside))
                evaluate("out-of-domain", inside[:k], inside[k:], held, args.seed, args, work, results, extra)
    # Pool the out-of-domain folds per model.
    pooled: dict = {}
    for name, split, pred, y, params in results:
        p, t, ps = pooled.setdefault((name, split), ([], [], []))
        p.append(pred)
        t.append(y)
        ps.append(params)
    table = []
    print(f"\n{'model':<19} {'split':<14} {'n':>5} {'MSE (GiB^2)':>12} {'RMSE MiB':>10} {'MAE MiB':>9} "
          f"{'R2':>7} {'MRE %':>7}")
    for split in ("in-domain", "out-of-domain"):
        for name in LEARNED + ["trace-forecast"]:
            if (name, split) not in pooled:
                continue
            p, t, ps = pooled[(name, split)]
            m = metrics(np.concatenate(p), np.concatenate(t))
            row = {"model": name, "split": split, **{k: (round(v, 6) if isinstance(v, float) else v)
                                                     for k, v in m.items()}, "tuned": ps}
            table.append(row)
            print(f"{name:<19} {split:<14} {m['n']:>5} {m['mse'] / 2**60:>12.5f} {m['rmse'] / 2**20:>10.2f} "
                  f"{m['mae'] / 2**20:>9.2f} {m['r2']:>7.4f} {m['mre_pct']:>7.2f}")
    print(f"\nBiGRU-Transformer inference: median {extra['inference_ms_median']:.2f} ms per job, p95 "
          f"{extra['inference_ms_p95']:.2f} ms (torch.ops.gpucast.predict_job, one thread)")
    for t in extra.get("bigru_training", []):
        print(f"  training ({t['split']}): {t.get('train_jobs')} jobs, best epoch {t.get('best_epoch')} of "
              f"{t.get('epochs')}, {t['wall_s']} s")
    print(json.dumps({"bench": "learned_memory", "jobs": len(rows), "label": "cpu-memory-proxy",
                      "inference_ms_median": round(extra["inference_ms_median"], 3),
                      "rows": [{k: r[k] for k in ("model", "split", "mse", "rmse", "mae", "r2", "mre_pct", "n")}
                               for r in table]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
