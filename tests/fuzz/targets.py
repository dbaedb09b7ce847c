"""The fuzz targets: one per parser, each reached through the route a user has.

Each target names its corpus (tests/data/fuzz/<name>/), how its inputs are mutated (json, config, weights) and
what it runs on one input in the child process (`run(path)`). A run returns normally when gpucast answered
(and the answer is sane: finite, and positive where it must be), raises ValueError where gpucast refused the input
as it should, and anything else is a fault: another exception type, a raw library message, `Garbage` (an answer
that is not finite or not positive), `NoFallback` (a GPU rates file that stops the forecast instead of falling back
to the shipped table), or the child dying or hanging (the runner sees those).

Nothing here imports torch at module level: the parent process (mutations, bookkeeping) stays light.
"""
from __future__ import annotations

import gzip
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
CORPUS = DATA / "fuzz"
WEIGHTS = ROOT / "predictor" / "weights"


class Garbage(Exception):
    """gpucast answered with a value that cannot be right (not finite, negative, zero where it must be positive)."""


class NoFallback(Exception):
    """A GPU rates file that cannot be used stopped the forecast instead of falling back to the shipped table."""


@dataclass(frozen=True)
class Target:
    name: str
    kind: str  # json, config, weights: how its inputs are mutated
    ext: str
    run: Callable[[str], None]
    env: bool = False  # a configuration string that travels through an environment variable
    doc: str = ""


# ---- checks ----------------------------------------------------------------------------------------------------


def finite(value, what: str, positive: bool = False, non_negative: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Garbage(f"{what} is {value!r}, not a number")
    if not math.isfinite(value):
        raise Garbage(f"{what} is {value!r}")
    if positive and value <= 0:
        raise Garbage(f"{what} is {value!r}, not positive")
    if non_negative and value < 0:
        raise Garbage(f"{what} is {value!r}, negative")


def check_memory_forecast(m, what: str) -> None:
    for k in ("peak_allocated_bytes", "peak_reserved_bytes"):
        finite(getattr(m, k), f"{what}.{k}", non_negative=True)
    for k, v in vars(m).items():
        if isinstance(v, float) and not math.isfinite(v):
            raise Garbage(f"{what}.{k} is {v!r}")


def check_time_forecast(tf, what: str) -> None:
    finite(tf.step_ms, f"{what}.step_ms", positive=True)
    for k in ("compute_ms", "forward_ms", "backward_ms", "optimizer_ms", "exposed_comm_ms", "comm_ms"):
        if hasattr(tf, k):
            finite(getattr(tf, k), f"{what}.{k}", non_negative=True)
    for k in ("alpha", "beta"):
        v = getattr(tf, k, 1.0)
        if getattr(tf, "correction", "") == "gnn" or v is None:
            finite(v, f"{what}.{k}", positive=True)


def check_correction(out: dict, what: str) -> None:
    finite(out["alpha"], f"{what}.alpha", positive=True)
    finite(out["beta"], f"{what}.beta", positive=True)
    finite(out["step_ms"], f"{what}.step_ms", non_negative=True)


def check_version_read(path: str, what: str, versions: tuple = (1,)) -> None:
    """An input gpucast accepted carries a schema_version it reads (`versions`): a version of 2**32 + 1 read as 1
    (a silent truncation) is a wrong answer, not an answer."""
    try:
        doc = json.loads(Path(path).read_bytes())
    except (ValueError, RecursionError):
        return  # what Python cannot read, gpucast read otherwise: nothing to compare
    v = doc.get("schema_version", 1) if isinstance(doc, dict) else 1
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v not in versions:
        raise Garbage(f"{what}: schema_version {v!r} accepted (gpucast reads {versions})")


def check_job_estimate(e: dict, what: str) -> None:
    finite(e["bytes"], f"{what}.bytes", positive=True)
    for k in ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "activation_bytes", "input_bytes"):
        if k in e:
            finite(e[k], f"{what}.{k}", non_negative=True)


# ---- what the targets share (built once per child process) -----------------------------------------------------

_cache: dict = {}


def _once(key: str, make: Callable):
    if key not in _cache:
        _cache[key] = make()
    return _cache[key]


def small_trace():
    """A real trace of a tiny model (the trace corpus's first file), loaded as a user loads one."""
    import gpucast
    return _once("trace", lambda: gpucast.load_trace(str(CORPUS / "trace" / "tiny_mlp.json")))


def _golden_timings():
    def make():
        import torch
        out = []
        for b in (2, 4, 8):
            text = gzip.decompress((DATA / "golden" / "probes" / f"mlp_{b}.json.gz").read_bytes()).decode()
            out.append(torch.ops.gpucast.trace_from_json(text).iteration_timing(b))
        return out
    return _once("timings", make)


def step_forecast(target: str):
    """A Forecast holding the committed MLP probes' timings (tests/data/golden/probes), as gpucast.forecast() leaves
    it: its step_time() is the public route of link=, parallel= and gnn= (the graph network's weights file)."""
    def make():
        from gpucast import _forecast, _results, _settings
        _settings._RATES.update(peak_gflops=100.0, mem_gbps=50.0)  # this CPU's rates, fixed: no measurement
        timings = _golden_timings()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tf = _forecast._forecast_time(timings, 32, target, "cpu", {}, None, gnn=None)
        memory = _results.MemoryForecast(**{k: 0 for k in _results.MemoryForecast.__dataclass_fields__
                                            if k not in ("warnings", "notes", "forecast_ms")} | {
            "target": target, "fragmentation": 0.0, "breakdown": {}, "peak_phase": "", "peak_op": "",
            "peak_module": "", "scaled": False})
        return _results.Forecast(memory=memory, probe_batch_sizes=(2, 4, 8), probe_device="cpu", context={}, time=tf,
                                 timings=timings, target=target, optimizer_name="adamw")
    return _once(f"forecast:{target}", make)


def recorded_graph() -> str:
    return _once("graph", lambda: (CORPUS / "step_graph" / "gpt2_h64_l2.json").read_text())


def fixture_jobs() -> list[str]:
    return sorted(str(p) for p in (CORPUS / "job").glob("*.json"))[:3]


def analytical_bytes(job: str) -> float:
    """The job's analytical estimate (weights that do not exist: the analytical model answers)."""
    import gpucast
    return _once(f"analytical:{job}", lambda: gpucast.predict_job(job, weights="/nonexistent/gpucast.gcw")["bytes"])


def _text(path: str) -> str:
    """A configuration string as the environment gives it to Python (bytes that are not UTF-8 as surrogates)."""
    return Path(path).read_bytes().decode("utf-8", "surrogateescape")


def _set_env(name: str, value: str) -> None:
    os.environ[name] = value.replace("\x00", "")


# ---- the targets -----------------------------------------------------------------------------------------------


def run_trace(path: str) -> None:
    """gpucast.load_trace (python -m gpucast report: load, summary, memory snapshot), repr, the window peak, and
    the forecast auto mode makes from a traced step (MemoryForecaster over the loaded trace)."""
    import gpucast
    from gpucast import _auto
    t = gpucast.load_trace(path)
    s = t.summary()
    if not isinstance(s, str):
        raise Garbage(f"summary() returned {type(s).__name__}")
    t.memory_snapshot()
    repr(t)
    finite(t.peak_bytes("cpu"), "peak_bytes('cpu')", non_negative=True)
    check_memory_forecast(_auto.forecast_traced_step(t, 2, "cpu"), "forecast")
    check_version_read(path, "load_trace", versions=(1, 2))


def run_job(path: str) -> None:
    """python -m gpucast predict-job job.json (gpucast.predict_job with the shipped model's weights)."""
    import gpucast
    check_job_estimate(gpucast.predict_job(path, weights=str(WEIGHTS / "job_memory.gcw")), "predict_job")
    check_version_read(path, "predict_job")


def run_job_weights(path: str) -> None:
    """python -m gpucast predict-job job.json --weights FILE on the corpus's jobs: a learned answer must be
    finite, positive and within 0.25x-4x of the analytical estimate (these jobs are inside the trained range)."""
    import gpucast
    for job in fixture_jobs():
        e = gpucast.predict_job(job, weights=path)
        check_job_estimate(e, f"predict_job({Path(job).name})")
        if e.get("method") == "learned":
            ratio = e["bytes"] / analytical_bytes(job)
            if not 0.25 <= ratio <= 4.0:
                raise Garbage(f"predict_job({Path(job).name}): learned {e['bytes']:.4g} B is {ratio:.3g}x the "
                              f"analytical estimate")


def run_step_gnn_weights(path: str) -> None:
    """forecast(gnn=FILE) / Forecast.step_time(gnn=FILE) on a CPU forecast, and step_correction of a recorded graph
    with the same file."""
    import torch
    fc = step_forecast("cpu")
    check_time_forecast(fc.step_time(32, gnn=path), "step_time(gnn=)")
    check_correction(json.loads(torch.ops.gpucast.step_correction(recorded_graph(), path)), "step_correction")


def run_gpu_rates(path: str) -> None:
    """gpucast.gpu_rates(path) (a ValueError is an answer), then GPUCAST_GPU_RATES=path under a forecast that
    prices a GPU from CPU probes: it must stand (the file's table, or the shipped one with a warning)."""
    import gpucast
    from gpucast import _forecast
    try:
        for g in gpucast.gpu_rates(path):
            finite(g["fp32_tflops"], f"gpu_rates {g.get('name')!r}.fp32_tflops", positive=True)
            finite(g["bandwidth_gbps"], f"gpu_rates {g.get('name')!r}.bandwidth_gbps", positive=True)
    except ValueError:
        pass
    _set_env("GPUCAST_GPU_RATES", path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                tf = _forecast._forecast_time(_golden_timings(), 64, "H100-80GB", "cpu", {}, None, gnn=None)
            except ValueError as e:
                raise NoFallback(f"the forecast failed on GPUCAST_GPU_RATES: {e}") from e
    finally:
        del os.environ["GPUCAST_GPU_RATES"]
    if tf is not None:
        check_time_forecast(tf, "H100 step time")


def run_step_graph(path: str) -> None:
    """torch.ops.gpucast.step_correction(graph): the step graph network's reader (the step-time dataset's records)."""
    import torch
    text = Path(path).read_bytes().decode("utf-8", "replace")  # the op takes a Python str: text, not bytes
    check_correction(json.loads(torch.ops.gpucast.step_correction(text, "")), "step_correction")


def run_auto_config(path: str) -> None:
    """GPUCAST_CONF as auto mode reads it (gpucast._auto.config()), then what auto mode does with it: the forecast
    of a traced step at its target and capacity, and the out-of-memory judgement."""
    from gpucast import _auto
    _set_env("GPUCAST_CONF", _text(path))
    _auto._config = None
    try:
        cfg = _auto.config()
    finally:
        del os.environ["GPUCAST_CONF"]
        _auto._config = None
    f = _auto.forecast_traced_step(small_trace(), 2, cfg["target"], cfg["capacity_mb"], cfg["warn_fraction"])
    check_memory_forecast(f, "auto forecast")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            _auto.judge(f, cfg["capacity_mb"], cfg["warn_fraction"], cfg["on_risk"])
        except _auto.OutOfMemoryRisk:
            pass


def run_link(path: str) -> None:
    """forecast(link="...") / Forecast.step_time(link=...) with data parallelism on a CPU forecast."""
    fc = step_forecast("cpu")
    check_time_forecast(fc.step_time(64, parallel={"dp": 2}, link=_text(path), gnn=None), "step_time(link=)")


def run_parallel(path: str) -> None:
    """The parallel configuration text forecast() builds from parallel= (any value of the dict lands in it):
    check_parallel, the step time's and the memory forecast's readers."""
    import torch
    from gpucast import _forecast
    text = _text(path)
    torch.ops.gpucast.check_parallel(text)
    out = json.loads(torch.ops.gpucast.forecast_step_time(_golden_timings(), 64, parallel=text,
                                                          link="alpha_us:35,bytes_per_us:1200"))
    finite(out["step_ms"], "step_ms", positive=True)
    f = torch.classes.gpucast.MemoryForecaster()
    f.add_probe(small_trace().handle, 2)
    check_memory_forecast(_forecast.run_forecaster(f, 64, "H100-80GB", 0, 0.9, "cpu", text, []), "memory")


def run_alloc_conf(path: str) -> None:
    """PYTORCH_CUDA_ALLOC_CONF as forecast() and auto mode read it, under a GPU target's memory forecast."""
    import torch
    from gpucast import _forecast
    os.environ.pop("PYTORCH_ALLOC_CONF", None)
    _set_env("PYTORCH_CUDA_ALLOC_CONF", _text(path))
    try:
        f = torch.classes.gpucast.MemoryForecaster()
        f.add_probe(small_trace().handle, 2)
        m = _forecast.run_forecaster(f, 8, "H100-80GB", 0, 0.9, "cpu", "", [])
    finally:
        del os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    check_memory_forecast(m, "memory")


TARGETS = {t.name: t for t in [
    Target("trace", "json", ".json", run_trace, doc=run_trace.__doc__),
    Target("job", "json", ".json", run_job, doc=run_job.__doc__),
    Target("job_weights", "weights", ".gcw", run_job_weights, doc=run_job_weights.__doc__),
    Target("step_gnn_weights", "weights", ".gcw", run_step_gnn_weights, doc=run_step_gnn_weights.__doc__),
    Target("gpu_rates", "json", ".json", run_gpu_rates, doc=run_gpu_rates.__doc__),
    Target("step_graph", "json", ".json", run_step_graph, doc=run_step_graph.__doc__),
    Target("auto_config", "config", ".txt", run_auto_config, env=True, doc=run_auto_config.__doc__),
    Target("link", "config", ".txt", run_link, doc=run_link.__doc__),
    Target("parallel", "config", ".txt", run_parallel, doc=run_parallel.__doc__),
    Target("alloc_conf", "config", ".txt", run_alloc_conf, env=True, doc=run_alloc_conf.__doc__),
]}


def classify(exc: BaseException) -> tuple[str, str]:
    """(outcome, message) of an exception: value-error is gpucast refusing the input; the rest are faults."""
    msg = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, Garbage):
        return "garbage", str(exc)
    if isinstance(exc, NoFallback):
        return "no-fallback", str(exc)
    text = str(exc)
    if "[json.exception." in text and (not isinstance(exc, ValueError) or text.lstrip().startswith("[json.")):
        return "raw-json-error", msg  # the library's own message with no path or field of gpucast's around it
    if isinstance(exc, UnicodeError):  # UnicodeDecodeError is a ValueError: no path, no field, no reason
        return type(exc).__name__, msg
    if isinstance(exc, ValueError):
        return "value-error", msg
    return type(exc).__name__, msg


def evaluate(target: str, path: str) -> tuple[str, str]:
    try:
        TARGETS[target].run(path)
    except Exception as e:  # noqa: BLE001 - every exception is an outcome here
        return classify(e)
    except RecursionError as e:  # pragma: no cover - a subclass of Exception on 3.x; kept for clarity
        return classify(e)
    return "ok", ""


def prepare(target: str) -> None:
    """What a target needs before its first input, so that its cost is not counted against that input."""
    if target in ("trace", "auto_config", "parallel", "alloc_conf"):
        small_trace()
    if target in ("parallel", "gpu_rates"):
        _golden_timings()
    if target in ("step_gnn_weights", "link"):
        step_forecast("cpu")
    if target == "job_weights":
        for job in fixture_jobs():
            analytical_bytes(job)


def setup_process() -> None:
    """The child's settings: one thread (the fuzzer uses one core), the shipped weights found where the build
    lays them out or in the source tree."""
    os.environ.setdefault("GPUCAST_JOB_WEIGHTS", str(WEIGHTS / "job_memory.gcw"))
    os.environ.setdefault("GPUCAST_STEP_GNN_WEIGHTS", str(WEIGHTS / "step_gnn.gcw"))
    for p in (ROOT, ROOT / "python"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    import torch
    torch.set_num_threads(1)
    __import__("gpucast")  # loads the library under test ($GPUCAST_LIBRARY) once, before the first input
