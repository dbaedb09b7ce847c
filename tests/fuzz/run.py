"""Fuzz gpucast's parsers: seeded mutations of real files, evaluated in a child process that survives nothing.

    PYTHONPATH=python:. .venv/bin/python tests/fuzz/run.py [--targets trace,job,...] [--seed 0]
        [--iterations N | --seconds S] [--known] [--crashes] [--out build/fuzz] [--json summary.json]
    PYTHONPATH=python:. .venv/bin/python tests/fuzz/run.py --target trace --input FILE   # one input, its outcome

Per target (targets.py: trace, job, job_weights, step_gnn_weights, gpu_rates, step_graph, auto_config, link,
parallel, alloc_conf) it evaluates the corpus's real files (tests/data/fuzz/<target>/*), with --known the inputs of
faults found before (<target>/known/), with --crashes the fuzzer's own saved finds (<target>/crashes/; a .gz file
is evaluated as its decompressed bytes; a .why file beside one says what it is), then N
mutations of the corpus (or as many as S seconds per target allow). GPUCAST_LIBRARY picks the library under test.

A child process imports gpucast once and evaluates input after input; before each it writes the input's index to a
progress file. Where the child dies (a signal) or does not answer within --timeout seconds, that input is a crash or
a hang: it is saved and a new child goes on with the next input. Outcomes: ok, value-error (gpucast refused the
input with a ValueError), or a fault: crash, hang, any other exception type (UnicodeDecodeError, TypeError,
RuntimeError, ...), raw-json-error (a raw nlohmann message), garbage (a non-finite or non-positive answer),
no-fallback (a GPU rates file that stopped the forecast). Each fault's input is saved under --out/<target>/, its
message beside it (.detail).
Exit status 1 when any fault was found.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import hashlib
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import mutate  # noqa: E402
from targets import CORPUS, ROOT, TARGETS  # noqa: E402

FAULT_FREE = ("ok", "value-error")


class Child:
    """The evaluating process: started on demand, restarted after a crash or hang."""

    def __init__(self, work: Path, timeout: float, startup_timeout: float = 180.0):
        self.work, self.timeout, self.startup_timeout = work, timeout, startup_timeout
        self.progress = work / "progress"
        self.log = work / "child.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        r, w = os.pipe()
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), str(ROOT), env.get("PYTHONPATH", "")])
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, str(HERE / "child.py"), str(self.progress), str(w)],
                                         stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, pass_fds=(w,),
                                         env=env, start_new_session=True, text=True)
        os.close(w)
        self.results = os.fdopen(r, "r")
        self.starts += 1
        line = self._readline(self.startup_timeout)
        if line != "ready\n":
            self.stop()
            raise RuntimeError(f"the fuzz child did not start (see {self.log}): {line!r}")

    def _readline(self, timeout: float) -> str | None:
        """A line from the child; "" at end of file (it died); None after timeout seconds without one."""
        ready, _, _ = select.select([self.results], [], [], timeout)
        return self.results.readline() if ready else None

    def stop(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.results.close()
            self.proc = None

    def evaluate(self, index: int, target: str, path: Path) -> tuple[str, str]:
        if self.proc is None:
            self.start()
        log_start = self.log.stat().st_size
        self.proc.stdin.write(f"{index}\t{target}\t{path}\n")
        self.proc.stdin.flush()
        line = self._readline(self.timeout)
        if line:
            r = json.loads(line)
            return r["outcome"], r["detail"]
        if line is None:
            self.stop()
            return "hang", f"no answer within {self.timeout:g} s"
        rc = self.proc.wait()
        self.results.close()
        self.proc = None
        try:
            at = int(self.progress.read_text() or -1)
        except (OSError, ValueError):
            at = -1
        tail = self.log.read_bytes()[log_start:][-1500:].decode("utf-8", "replace").strip()
        how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
        where = "" if at == index else f" (progress file says input {at})"
        return "crash", f"{how}{where}" + (f"\n{tail}" if tail else "")


def seeds_of(target: str) -> list[Path]:
    d = CORPUS / target
    return sorted(p for p in d.iterdir() if p.is_file() and not p.name.startswith(".")) if d.is_dir() else []


def saved_of(target: str, sub: str) -> list[Path]:
    d = CORPUS / target / sub
    return sorted(p for p in d.iterdir() if p.is_file() and p.suffix not in (".detail", ".why")
                  and not p.name.startswith(".")) if d.is_dir() else []


class Mutator:
    def __init__(self, target: str, seed: int, max_bytes: int):
        self.t = TARGETS[target]
        self.rng = random.Random(f"{seed}:{target}")
        self.seeds = [p.read_bytes() for p in seeds_of(target)]
        if not self.seeds:
            raise SystemExit(f"no corpus for target {target} in {CORPUS / target}")
        self.max_bytes = max_bytes
        texts = [s.decode("utf-8", "surrogateescape") for s in self.seeds] if self.t.kind == "config" else []
        self.words = mutate.config_words(texts)

    def next(self) -> bytes:
        seed = self.rng.choice(self.seeds)
        if self.t.kind == "json":
            return mutate.mutate_json(self.rng, seed, self.max_bytes)
        if self.t.kind == "weights":
            return mutate.mutate_weights(self.rng, seed, self.max_bytes)
        text = mutate.mutate_config(self.rng, seed.decode("utf-8", "surrogateescape"), self.max_bytes // 16,
                                    self.words, self.t.env)
        return text.encode("utf-8", "surrogateescape")


def signature(target: str, kind: str, detail: str) -> str:
    """What makes two faults the same one: the target, the kind and the message's first line without its numbers,
    quoted values and paths (a crash: its signal)."""
    first = detail.split("\n", 1)[0]
    first = re.sub(r"'[^']*'|\"[^\"]*\"", "Q", first)
    first = re.sub(r"(/[\w.+-]+)+", "P", first)
    first = re.sub(r"0x[0-9a-fA-F]+", "H", first)
    first = re.sub(r"-?\d+(\.\d+)?(e[+-]?\d+)?", "N", first)
    return f"{target}|{kind}|{first[:160]}"


def run(args) -> dict:
    out = Path(args.out).resolve()
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    child = Child(work, args.timeout)
    summary: dict = {"seed": args.seed, "library": os.environ.get("GPUCAST_LIBRARY", ""), "targets": {},
                     "faults": []}
    index = 0
    seen: set = set()
    try:
        for name in args.targets:
            t = TARGETS[name]
            counts: collections.Counter = collections.Counter()
            stats = {"tried": 0, "corpus": 0, "known": 0, "crashes": 0, "mutations": 0, "seconds": 0.0}
            summary["targets"][name] = stats
            t0 = time.monotonic()
            fixed = [("corpus", p) for p in seeds_of(name)]
            if args.known:
                fixed += [("known", p) for p in saved_of(name, "known")]
            if args.crashes:
                fixed += [("crashes", p) for p in saved_of(name, "crashes")]
            mut = Mutator(name, args.seed, args.max_bytes)
            n = 0
            work_input = work / f"input{t.ext}"

            def one(origin: str, path: Path, data: bytes | None, run_as: Path | None = None) -> None:
                nonlocal index
                if data is not None:
                    (run_as or path).write_bytes(data)
                outcome, detail = child.evaluate(index, name, run_as or path)
                index += 1
                stats["tried"] += 1
                stats[origin] += 1
                counts[outcome] += 1
                if outcome in FAULT_FREE:
                    return
                saved = path
                if origin == "mutations":
                    digest = hashlib.sha1(data).hexdigest()[:12]
                    saved = out / name / f"{outcome}-{digest}{t.ext}"
                    saved.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(path, saved)
                    saved.with_suffix(saved.suffix + ".detail").write_text(detail + "\n")
                sig = signature(name, outcome, detail)
                fault = {"target": name, "kind": outcome, "origin": origin, "input": str(saved),
                         "detail": detail, "new": sig not in seen, "signature": sig}
                seen.add(sig)
                summary["faults"].append(fault)
                if not args.quiet and fault["new"]:
                    print(f"  FAULT {name} {outcome} ({origin}) {saved}\n    {detail.splitlines()[0][:300]}",
                          flush=True)

            for origin, p in fixed:
                if p.suffix == ".gz":  # a saved input stored compressed: evaluated as its plain bytes
                    one(origin, p, gzip.decompress(p.read_bytes()), work / f"saved{t.ext}")
                else:
                    one(origin, p, None)
            while True:
                if args.seconds is not None and time.monotonic() - t0 >= args.seconds:
                    break
                if args.seconds is None and n >= args.iterations:
                    break
                one("mutations", work_input, mut.next())
                n += 1
            stats["seconds"] = round(time.monotonic() - t0, 1)
            stats["outcomes"] = dict(counts)
            if not args.quiet:
                faults = {k: v for k, v in counts.items() if k not in FAULT_FREE}
                print(f"{name}: {stats['tried']} inputs ({stats['corpus']} corpus, {stats['known']} known, "
                      f"{stats['crashes']} saved crashes, {stats['mutations']} mutations) in {stats['seconds']} s: "
                      f"ok {counts['ok']}, value-error {counts['value-error']}, faults "
                      f"{dict(sorted(faults.items())) or 'none'}", flush=True)
    finally:
        child.stop()
    summary["child_starts"] = child.starts
    return summary


def report(summary: dict) -> str:
    lines = [f"{'target':<18} {'tried':>7} {'mutations':>9} {'ok':>7} {'value-error':>11}  faults by kind"]
    for name, s in summary["targets"].items():
        o = s.get("outcomes", {})
        faults = ", ".join(f"{k} {v}" for k, v in sorted(o.items()) if k not in FAULT_FREE) or "none"
        lines.append(f"{name:<18} {s['tried']:>7} {s['mutations']:>9} {o.get('ok', 0):>7} "
                     f"{o.get('value-error', 0):>11}  {faults}")
    distinct = [f for f in summary["faults"] if f["new"]]
    lines.append(f"{len(summary['faults'])} faults, {len(distinct)} distinct:")
    for f in distinct:
        lines.append(f"  {f['target']:<16} {f['kind']:<18} {f['origin']:<9} {f['input']}")
        lines.append(f"      {f['detail'].splitlines()[0][:200] if f['detail'] else ''}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated (default: all)")
    p.add_argument("--target", help="with --input: the target of that one input")
    p.add_argument("--input", help="evaluate this one file and print its outcome")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iterations", type=int, default=100, help="mutations per target")
    p.add_argument("--seconds", type=float, help="instead of --iterations: seconds of mutations per target")
    p.add_argument("--known", action="store_true", help="also the inputs of known faults (<target>/known/)")
    p.add_argument("--crashes", action="store_true", help="also the saved finds (<target>/crashes/)")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds an input may take (else: a hang)")
    p.add_argument("--max-bytes", type=int, default=4 << 20, help="largest mutated input")
    p.add_argument("--out", default=str(ROOT / "build" / "fuzz"), help="where fault inputs are saved")
    p.add_argument("--json", help="write the summary (counts and faults) here")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.input:
        if not args.target:
            p.error("--input needs --target")
        work = Path(args.out).resolve() / "work"
        work.mkdir(parents=True, exist_ok=True)
        child = Child(work, args.timeout)
        path = Path(args.input).resolve()
        if path.suffix == ".gz":
            plain = work / f"saved{TARGETS[args.target].ext}"
            plain.write_bytes(gzip.decompress(path.read_bytes()))
            path = plain
        try:
            outcome, detail = child.evaluate(0, args.target, path)
        finally:
            child.stop()
        print(f"{args.target} {args.input}: {outcome}" + (f"\n{detail}" if detail else ""))
        return 0 if outcome in FAULT_FREE else 1
    args.targets = [t for t in args.targets.split(",") if t]
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        p.error(f"unknown targets {unknown}; known: {', '.join(TARGETS)}")
    summary = run(args)
    print(report(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if summary["faults"] else 0


if __name__ == "__main__":
    sys.exit(main())
