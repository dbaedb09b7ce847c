"""gpucast.calibrate() on a real gloo process group over loopback (two processes, one thread each)."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import gpucast

ROOT = Path(__file__).resolve().parents[2]
WORKER = """
import json, os, sys, time
sys.path[:0] = [{root!r}, {python!r}]
import torch, torch.distributed as dist
torch.set_num_threads(1)
import gpucast
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=2)
if {mode!r} == "hang" and rank == 1:
    time.sleep(8)  # never joins the collective
    sys.exit(0)
if {mode!r} == "hang_in_ddp" and rank == 1:  # leaves before DDP's own collectives
    from gpucast import _calibrate
    def gone(*args, **kwargs):
        time.sleep({timeout} + 6)
        os._exit(0)
    _calibrate._ddp_overhead = gone
if {mode!r} == "hang_in_sends" and rank == 1:  # leaves before the point-to-point sends
    from gpucast import _calibrate
    def gone(*args, **kwargs):
        time.sleep({timeout} + 6)
        os._exit(0)
    _calibrate._sends = gone
if {mode!r} == "hang_in_fsdp" and rank == 1:  # leaves before FSDP's small models
    from gpucast import _calibrate
    def gone(*args, **kwargs):
        time.sleep({timeout} + 6)
        os._exit(0)
    _calibrate._fsdp_overhead = gone
if {mode!r} == "late":  # rank 1's compute before each sample takes 200 ms longer than rank 0's
    import datetime
    from gpucast import _calibrate
    sizes = (2**16, 2**18, 2**20, 2**22)
    def wait(work, what):
        assert work.wait(datetime.timedelta(seconds=60)) is not False, what
    samples, gap = _calibrate._after_compute(sizes, [torch.ones(s // 4) for s in sizes], 3, None, wait, 2,
                                        burst=lambda: time.sleep(0.2 if rank == 1 else 0.0))
    if rank == 0:
        print(json.dumps({{"samples": [{{"bytes": b, "us": u}} for b, u in samples], "gap_us": gap}}), flush=True)
    os._exit(0)
if {mode!r}.startswith("slow_exit"):  # rank 1 leaves each all-reduce 50 ms after rank 0
    import datetime
    if {mode!r} == "slow_exit_oversubscribed":  # both ranks' threads fill every core, twice over
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    from gpucast import _calibrate
    sizes = (2**16, 2**20)
    def wait(work, what):
        assert work.wait(datetime.timedelta(seconds=60)) is not False, what
        if rank == 1:
            time.sleep(0.05)
    samples, gap = _calibrate._after_compute(sizes, [torch.ones(s // 4) for s in sizes], 3, None, wait, 2,
                                        burst=lambda: None)
    if rank == 0:
        print(json.dumps({{"samples": [{{"bytes": b, "us": u}} for b, u in samples], "gap_us": gap}}), flush=True)
    os._exit(0)
if {mode!r} == "sharing_oversubscribed":  # both ranks' threads fill every core, twice over
    import datetime
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    from gpucast import _calibrate
    def wait(work, what):
        assert work.wait(datetime.timedelta(seconds=60)) is not False, what
    out = _calibrate._host_sharing(2, None, wait)
    if rank == 0:
        print(json.dumps(out), flush=True)
    os._exit(0)
if {mode!r} == "no_scatter":  # a backend without reduce-scatter
    def unsupported(*args, **kwargs):
        raise RuntimeError("reduce_scatter_tensor is not supported here")
    dist.reduce_scatter_tensor = unsupported
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        r = gpucast.calibrate(sizes=(2**16, 2**18, 2**20, 2**22), repeats=3, timeout_s={timeout})
        out = r
    except Exception as e:
        out = {{"error": type(e).__name__ + ": " + str(e)}}
if {mode!r} == "no_scatter":
    out["warned"] = [str(w.message) for w in caught if "gpucast" in str(w.message)]
if rank == 0 or "error" in out:
    print(json.dumps(out), flush=True)
os._exit(0)
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(tmp_path, mode, timeout):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(root=str(ROOT), python=str(ROOT / "python"), port=free_port(), mode=mode,
                                    timeout=timeout))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LOCAL_WORLD_SIZE", None)  # the two ranks are the world, on this host
    procs = [subprocess.Popen([sys.executable, str(script), str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    r = json.loads(outs[0][0].strip().splitlines()[-1])
    other = outs[1][0].strip().splitlines()
    if "error" in r and other:  # what went wrong on rank 1 too
        r["error"] += " (rank 1: " + json.loads(other[-1]).get("error", "") + ")"
    return r


def test_calibrate_fits_a_link_on_gloo(tmp_path):
    r = run_pair(tmp_path, "ok", 60)
    assert "error" not in r, r["error"]
    assert r["ranks"] == 2 and r["backend"] == "gloo"
    assert [s["bytes"] for s in r["samples"]] == [2**16, 2**18, 2**20, 2**22]
    assert r["bytes_per_us"] > 0 and r["alpha_us"] >= 0
    # How the two ranks share this host: one thread each, LOCAL_WORLD_SIZE unset (the world: 2 ranks).
    assert r["local_ranks"] == 2 and r["threads"] == 1 and r["cores"] == len(os.sched_getaffinity(0))
    assert r["overlap"] is (2 < r["cores"])
    assert r["memory_contention"] >= 1.0 and r["compute_contention"] >= 1.0 and r["balance"] > 0
    assert r["sync_wait_us"] >= 0 and r["ddp_overhead_us"] >= 0
    # DDP's cost outside backward on two models, by their gradient bytes; the first is ddp_overhead_us.
    assert [s["bytes"] for s in r["ddp_overhead_samples"]] == [19240, 2316840]
    assert r["ddp_overhead_samples"][0]["us"] == r["ddp_overhead_us"] and r["ddp_overhead_samples"][1]["us"] >= 0
    assert r["drift_compute"] >= 0 and r["drift_memory"] >= 0
    # The second sweep, after a burst of compute five times longer: every size up to 4 MiB.
    assert [s["bytes"] for s in r["late_samples"]] == [2**16, 2**18, 2**20, 2**22]
    assert all(s["us"] > 0 for s in r["late_samples"])
    assert 0 < r["samples_gap_us"] < r["late_gap_us"]
    # Point-to-point sends between the two ranks, one way, every size.
    assert [s["bytes"] for s in r["send_samples"]] == [2**16, 2**18, 2**20, 2**22]
    assert all(s["us"] > 0 for s in r["send_samples"])
    # FSDP's own work per unit, layer with parameters and MiB.
    assert all(r[k] >= 0 for k in ("fsdp_overhead_unit_us", "fsdp_overhead_layer_us", "fsdp_overhead_mib_us"))
    assert r["fsdp_overhead_unit_us"] + r["fsdp_overhead_layer_us"] + r["fsdp_overhead_mib_us"] > 0
    # All-gathers and reduce-scatters of every size (the whole tensor's bytes).
    for key in ("all_gather_samples", "reduce_scatter_samples"):
        assert [s["bytes"] for s in r[key]] == [2**16, 2**18, 2**20, 2**22]
        assert all(s["us"] > 0 for s in r[key])
    # What the forecast reads from it: the samples, their rank count and the host keys.
    from gpucast._settings import _format_link
    text = _format_link(r)
    assert text.startswith(f"alpha_us:{r['alpha_us']},bytes_per_us:{r['bytes_per_us']},samples:65536/")
    samples = ";".join(f"{s['bytes']}/{s['factor']:.17g}" for s in r["memory_contention_samples"])
    assert [s["bytes"] for s in r["memory_contention_samples"]] == [2 << 20, 8 << 20, 32 << 20, 128 << 20]
    assert all(s["factor"] >= 1.0 for s in r["memory_contention_samples"])
    late = ";".join(f"{s['bytes']:.17g}/{s['us']:.17g}" for s in r["late_samples"])
    def pairs(key):
        return ";".join(f"{s['bytes']:.17g}/{s['us']:.17g}" for s in r[key])
    sends = pairs("send_samples")
    assert text.endswith(f",ranks:2,samples_gap_us:{r['samples_gap_us']},late_samples:{late},"
                         f"late_gap_us:{r['late_gap_us']},overlap:{r['overlap']},"
                         f"memory_contention:{r['memory_contention']},"
                         f"memory_contention_samples:{samples},"
                         f"compute_contention:{r['compute_contention']},balance:{r['balance']},"
                         f"sync_wait_us:{r['sync_wait_us']},drift_compute:{r['drift_compute']},"
                         f"drift_memory:{r['drift_memory']},ddp_overhead_us:{r['ddp_overhead_us']},"
                         f"ddp_overhead_samples:19240/{r['ddp_overhead_us']:.17g};2316840/"
                         f"{r['ddp_overhead_samples'][1]['us']:.17g},"
                         f"fsdp_overhead_unit_us:{r['fsdp_overhead_unit_us']},"
                         f"fsdp_overhead_layer_us:{r['fsdp_overhead_layer_us']},"
                         f"fsdp_overhead_mib_us:{r['fsdp_overhead_mib_us']},send_samples:{sends},"
                         f"all_gather_samples:{pairs('all_gather_samples')},"
                         f"reduce_scatter_samples:{pairs('reduce_scatter_samples')}")
    # four all-reduce samples, four late ones, four contention samples, two DDP overheads, four sends, four
    # all-gathers and four reduce-scatters
    assert text.count(";") == 3 + 3 + 3 + 1 + 3 + 3 + 3


def test_a_late_rank_is_not_counted_in_the_samples(tmp_path):
    # The samples are timed from the last rank's arrival to the last rank's exit (the ranks share this host's
    # clock): rank 1's 200 ms
    # delay before each all-reduce is the lag sync_wait_us accounts for, not the collective's time. Timed from
    # rank 0's own arrival, the mean over both ranks would be at least 100 ms.
    r = run_pair(tmp_path, "late", 60)
    assert [s["bytes"] for s in r["samples"]] == [2**16, 2**18, 2**20, 2**22]
    assert all(0 < s["us"] < 100e3 for s in r["samples"]), r["samples"]
    # The idle spell before each sample: the mean burst over both ranks, 0 and 200 ms.
    assert 100e3 <= r["gap_us"] < 110e3, r["gap_us"]


def test_the_samples_last_until_the_last_rank_leaves(tmp_path):
    # Rank 1 leaves every all-reduce 50 ms after rank 0 (and so also arrives at the next one 50 ms later): in a
    # training loop the next collective waits for it, so each sample runs from the last arrival to the last exit,
    # at least 50 ms. Up to the mean exit over both ranks it would be about 25 ms.
    r = run_pair(tmp_path, "slow_exit", 60)
    assert [s["bytes"] for s in r["samples"]] == [2**16, 2**20]
    if len(os.sched_getaffinity(0)) >= 2:  # one thread per rank: the ranks' threads fit the cores
        assert all(50e3 <= s["us"] < 100e3 for s in r["samples"]), r["samples"]
    # With more threads than cores a late exit is time sharing, which the contention factors count: each rank's
    # own exit, about 25 ms on average over the two.
    r = run_pair(tmp_path, "slow_exit_oversubscribed", 60)
    assert all(25e3 <= s["us"] < 50e3 for s in r["samples"]), r["samples"]


def test_a_collective_that_hangs_times_out(tmp_path):
    r = run_pair(tmp_path, "hang", 2)
    assert r["error"].startswith("TimeoutError: gpucast.calibrate: an all-reduce of 65536 bytes did not complete "
                                 "within 2 s on 2 ranks (gloo)"), r


def test_ddp_collectives_that_hang_time_out(tmp_path):
    # DDP's broadcast and all-reduces run outside the calibration's own waits: a group with the timeout bounds them.
    r = run_pair(tmp_path, "hang_in_ddp", 3)
    assert r["error"].startswith("TimeoutError: gpucast.calibrate: DDP's steps on a small model did not complete "
                                 "within 3 s on 2 ranks (gloo): "), r


def test_sends_that_hang_time_out(tmp_path):
    r = run_pair(tmp_path, "hang_in_sends", 3)
    assert r["error"].startswith("TimeoutError: gpucast.calibrate: a barrier before the sends did not complete "
                                 "within 3 s on 2 ranks (gloo)"), r


def test_fsdp_steps_that_hang_do_not_hang_the_calibration(tmp_path):
    # Rank 0 waits for rank 1 to create the one-rank groups (or at a barrier) at most the timeout: it then leaves
    # FSDP's keys out with a warning, or raises, but returns.
    r = run_pair(tmp_path, "hang_in_fsdp", 3)
    if "error" in r:
        assert r["error"].startswith("TimeoutError: gpucast.calibrate: a barrier did not complete within 3 s"), r
    else:
        assert "fsdp_overhead_unit_us" not in r and "alpha_us" in r


def test_a_backend_without_reduce_scatter_keeps_the_rest(tmp_path):
    r = run_pair(tmp_path, "no_scatter", 60)
    assert "error" not in r, r["error"]
    assert "reduce_scatter_samples" not in r
    assert [s["bytes"] for s in r["all_gather_samples"]] == [2**16, 2**18, 2**20, 2**22]
    # A loaded host may add the samples-do-not-grow warning (timings, not this test's subject); nothing else.
    noisy = "gpucast.calibrate: the all-reduce samples do not grow with the size"
    assert [w for w in r["warned"] if not w.startswith(noisy)] == [
        "gpucast.calibrate: a reduce-scatter cannot run on this process group (reduce_scatter_tensor "
        "is not supported here); FSDP's and ZeRO's reduce-scatters are priced as half an all-reduce"]


def test_without_a_process_group():
    with pytest.raises(RuntimeError, match=r"gpucast.calibrate: torch.distributed is not initialized; call "
                                           r"torch.distributed.init_process_group"):
        gpucast.calibrate()


def test_bad_arguments_are_said_before_any_collective():
    # Without a process group: the arguments are checked first.
    with pytest.raises(ValueError, match=r"gpucast.calibrate: sizes must hold at least two different sizes \(the "
                                         r"link's latency and bandwidth are fitted to them\), got \(1048576, 1048576\)"):
        gpucast.calibrate(sizes=(1 << 20, 1 << 20))
    with pytest.raises(ValueError, match=r"gpucast.calibrate: sizes must be at least 4 bytes and repeats at least 1, "
                                         r"got \(2, 1024\), None"):
        gpucast.calibrate(sizes=(2, 1024))
    with pytest.raises(ValueError, match=r"got \(1024, 4096\), 0"):
        gpucast.calibrate(sizes=(1024, 4096), repeats=0)
    with pytest.raises(ValueError, match=r"gpucast.calibrate: sizes must be byte counts \(integers of at least 4\), "
                                         r"got \('a', 4096\)"):
        gpucast.calibrate(sizes=("a", 4096))
    for bad in (0, -1, "60", True):
        with pytest.raises(ValueError, match=rf"gpucast.calibrate: timeout_s must be a positive number of seconds, "
                                             rf"got {bad!r}"):
            gpucast.calibrate(timeout_s=bad)


def test_a_group_of_one_rank_is_refused_before_any_collective(tmp_path):
    script = tmp_path / "one.py"
    script.write_text(
        f"import sys\nsys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'python')!r}]\n"
        "import torch.distributed as dist, gpucast\n"
        f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)\n"
        "try:\n    gpucast.calibrate()\nexcept ValueError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.stdout.strip().splitlines()[-1] == (
        "gpucast.calibrate: the process group has 1 rank; a link needs at least 2 (call it on every rank of a group "
        "of two or more)"), out.stderr[-2000:]


def test_samples_that_do_not_grow_with_the_size_fit_a_bandwidth_alone():
    import torch
    from gpucast import _calibrate
    good = [(65536.0, 500.0), (1048576.0, 1400.0), (4194304.0, 4400.0)]
    assert _calibrate._fit_link(good, 2) == tuple(torch.ops.gpucast.fit_allreduce(
        [s for s, _ in good], [t for _, t in good], 2))
    # A noisy host: the larger size measured faster. Ring model with no latency, 2 ranks: T = S / B, weighted by
    # 1/T^2: 1/B = (1024/300 + 4096/200) / ((1024/300)^2 + (4096/200)^2).
    with pytest.warns(UserWarning, match=r"gpucast.calibrate: the all-reduce samples do not grow with the size "
                                         r"\(1024 B: 300 us, 4096 B: 200 us; a noisy host\?\): the link's bandwidth "
                                         r"is fitted with no latency"):
        alpha, bw = _calibrate._fit_link([(1024.0, 300.0), (4096.0, 200.0)], 2)
    assert alpha == 0.0
    assert bw == pytest.approx(((1024 / 300) ** 2 + (4096 / 200) ** 2) / (1024 / 300 + 4096 / 200), rel=1e-12)
    # What _fit_link reads: the error's code, not its text.
    from gpucast._errors import error_code
    with pytest.raises(ValueError) as e:
        torch.ops.gpucast.fit_allreduce([1024.0, 4096.0], [300.0, 200.0], 2)
    assert error_code(e.value) == "link-bandwidth"
    assert error_code(ValueError("fit: the all-reduce samples give a non-positive bandwidth")) is None


def test_oversubscribed_ranks_get_no_drift_rates(tmp_path):
    # Two ranks with as many threads each as there are cores: their drift apart is time sharing, which the
    # contention factors (at least threads / cores) count; the constant lag stays, the drift rates are left out.
    r = run_pair(tmp_path, "sharing_oversubscribed", 60)
    cores = len(os.sched_getaffinity(0))
    assert (r["local_ranks"], r["threads"], r["cores"]) == (2, cores, cores)
    assert r["compute_contention"] >= 2.0 and r["memory_contention"] >= 2.0
    assert r["overlap"] is False
    assert r["sync_wait_us"] >= 0
    assert "drift_compute" not in r and "drift_memory" not in r
