"""What timing the probes in several rounds buys (forecast's timing_rounds), measured in one run.

For each of the accuracy bench's ten CPU cases (bench/step_time_accuracy.py: random weights, AdamW, one thread, a
quarter of the layers timed), --repeats times: the real step measured as there (the median of --iterations, half
before the forecast on the same model built again, half after it), and one forecast with three timing rounds.
From that forecast's rounds, the step is forecast again (fc.step_time over other timings, the same probes'
structure) by each rule: each round alone ("round 1" is what timing_rounds=1 gives), the median of the first two
and of all three (element-wise, the forecast's rule), and per probe the round whose untraced step was fastest or
the median one. Without the graph network and with it. Printed per rule: mean |error|, RMS and mean signed error
over every forecast, and the coefficient of variation of each case's forecasts across the repeats (averaged over
the cases: how far a forecast moves when run again). Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "python"), str(ROOT / "bench")]


def _wall(text):
    return json.loads(text)["untraced_wall_ns"]


def rules(rounds):
    from gpucast._probes import _round_median  # the forecast's own rule

    def per_probe(choose):
        return [choose(sorted(xs, key=_wall)) for xs in zip(*rounds)]
    out = {f"round {i + 1}": r for i, r in enumerate(rounds)}
    out["median of rounds 1-2"] = _round_median(rounds[:2])
    out["median of 3 (forecast's rule)"] = _round_median(rounds)
    out["fastest round per probe"] = per_probe(lambda xs: xs[0])
    out["median round per probe"] = per_probe(lambda xs: xs[len(xs) // 2])
    return out


def main():
    import torch
    import gpucast
    import step_time_accuracy as sta
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(sta.CASES))
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--fraction", type=float, default=0.25)
    args = ap.parse_args()
    torch.set_num_threads(1)
    records = []
    for r in range(args.repeats):
        for name in args.cases.split(","):
            batch = sta.CASES[name]
            case = sta.case_of(name)
            fc, _, measured, iqr, seconds = sta.bracketed(
                lambda: sta.build(name)[1:], case.make_batch, batch, args.iterations,
                lambda model, opt, step: gpucast.forecast(step, case.make_batch, batch, model=model, optimizer=opt,
                                                          target="cpu", time_fraction=args.fraction,
                                                          timing_rounds=3))
            ms = {}
            for rule, timings in rules(fc.timing_rounds).items():
                again = dataclasses.replace(fc, timings=timings)
                ms[rule] = [again.step_time(batch, gnn=None).step_ms, again.step_time(batch).step_ms]
            walls = [[round(_wall(x) / 1e6, 3) for x in rnd] for rnd in fc.timing_rounds]
            records.append({"case": name, "repeat": r, "batch": batch, "measured_ms": round(measured, 3),
                            "iqr_ms": round(iqr, 3), "forecast_s": round(seconds, 2), "untraced_walls_ms": walls,
                            "forecast_ms": {k: [round(x, 3) for x in v] for k, v in ms.items()}})
            errs = ", ".join(f"{100 * (v[0] - measured) / measured:+.1f}" for v in ms.values())
            print(f"repeat {r} {name:<20} measured {measured:8.2f} ms; errors without the network by rule: {errs}",
                  flush=True)
    table = {}
    print(f"\n{'rule':<32} {'network':<8} {'mean |err| %':>12} {'RMS %':>7} {'signed %':>9} {'CV across repeats %':>20}")
    for rule in records[0]["forecast_ms"]:
        for g, label in ((0, "without"), (1, "with")):
            errs = [100 * (x["forecast_ms"][rule][g] - x["measured_ms"]) / x["measured_ms"] for x in records]
            by_case = defaultdict(list)
            for x in records:
                by_case[x["case"]].append(x["forecast_ms"][rule][g])
            cv = statistics.mean(100 * statistics.pstdev(v) / statistics.mean(v) for v in by_case.values())
            row = {"mre_pct": statistics.mean(map(abs, errs)), "rms_pct": statistics.mean(e * e for e in errs) ** 0.5,
                   "signed_pct": statistics.mean(errs), "cv_pct": cv}
            table[f"{rule} | {label}"] = {k: round(v, 3) for k, v in row.items()}
            print(f"{rule:<32} {label:<8} {row['mre_pct']:>12.2f} {row['rms_pct']:>7.2f} {row['signed_pct']:>+9.2f} "
                  f"{cv:>20.2f}")
    print(f"{len(records)} forecasts ({args.repeats} repeats of {len(records) // args.repeats} cases); forecast "
          f"time with three rounds {min(x['forecast_s'] for x in records):.1f} to "
          f"{max(x['forecast_s'] for x in records):.1f} s")
    print(json.dumps({"bench": "timing_rounds", "table": table, "records": records}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
