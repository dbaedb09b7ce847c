"""Pipeline parallelism on the real engine: gpucast's 1F1B forecast against a measured micro-batched pipeline.

N processes on this machine (--world, default 2), gloo on loopback, one thread each. Each case is a model built
as an nn.Sequential of blocks (a deep MLP; a GPT-style decoder: embeddings, transformer blocks, final norm and
head), so that it can be cut between any two of its top-level children. Rank 0 forecasts the pipelined step
(gpucast.forecast(..., parallel=dict(pp=N, micro_batches=M)), target "cpu") from single-process probes of the
whole model plus gpucast.calibrate() on the live group; the forecast's own split of the layers into stages
(fc.time.per_layer[i]["stage"]) decides where the real model is cut, so both run the same stages. Every rank
then runs its stage under 1F1B over M micro-batches in the order gpucast simulates (schedule(); a test checks it
against the forecast's timeline), AdamW on its own parameters, and times --iterations steps after 3 warm-up
steps; the step ends when the slowest rank's ends (per iteration, the largest of the ranks' times; the median
over the iterations is the measured step, with its interquartile range). The whole run is repeated --repeats
times in fresh processes (the machine is shared); per case the repeat with the median error is kept and every
repeat's error printed beside it. PyTorch's own schedules (torch.distributed.pipelining) batch their sends and
receives, which deadlocked over gloo here (torch 2.14): the stages send and receive with plain point-to-point
calls instead (one_f_one_b).

Printed beside the error: the forecast's compute (the slowest stage's work), its bubble (fill and drain), its
point-to-point sends, and each rank's time waiting in receives and working (its step less those waits) against
the work the forecast lays on its stage (its spans on the forecast's timeline). No target: the issue's pipeline
target is NeuSight's pp4 GPU data (bench/neusight_parallel.py); this checks the 1F1B model on a measured
micro-batched pipeline. Last line: one JSON object.

    python bench/pipeline_live.py [--cases mlp,gpt] [--world 2] [--micro-batches 4] [--iterations 30] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]

from step_time_accuracy import launch_ranks, median_repeats, summary  # noqa: E402  the DDP bench's helpers

BATCH = {"mlp": 512, "gpt": 64}


def make_case(name: str):
    """(model, make_batch, loss_fn): an nn.Sequential cut-able between any two top-level children."""
    import torch
    from torch import nn
    import torch.nn.functional as F
    from examples import zoo

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name == "mlp":
        layers = []
        for _ in range(6):
            layers += [nn.Sequential(nn.Linear(1024, 1024), nn.ReLU())]
        model = nn.Sequential(*layers, nn.Linear(1024, 10))

        def make_batch(n):
            return torch.randn(n, 1024, generator=gen), torch.randint(0, 10, (n,), generator=gen)

        return model, make_batch, F.cross_entropy
    if name == "gpt":
        vocab, seq, d = 512, 64, 128

        class Embed(nn.Module):
            def __init__(self):
                super().__init__()
                self.tok = nn.Embedding(vocab, d)
                self.pos = nn.Embedding(seq, d)

            def forward(self, tokens):
                return self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))

        model = nn.Sequential(Embed(), *(zoo.Block(d, 4) for _ in range(4)), nn.LayerNorm(d),
                              nn.Linear(d, vocab, bias=False))

        def make_batch(n):
            tokens = torch.randint(0, vocab, (n, seq), generator=gen)
            return tokens, torch.randint(0, vocab, (n, seq), generator=gen)

        def loss(logits, targets):
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

        return model, make_batch, loss
    raise SystemExit(f"unknown case {name!r}; valid: {', '.join(BATCH)}")


def top_child(layer: str, model) -> int | None:
    """The index of the top-level child a forecast layer path ("Sequential.3.attn.qkv") lies in; None outside."""
    parts = layer.split(".")
    if len(parts) < 2 or not parts[1].isdigit() or int(parts[1]) >= len(model):
        return None
    return int(parts[1])


def cuts_of(time, model, world: int) -> list[int]:
    """Where each stage's top-level children start, from the forecast's stage of every layer (time: the forecast's
    TimeForecast): the first child of stage s is the child of the first layer placed on stage s."""
    starts = [0] * world
    seen = set()
    for layer in time.per_layer:
        child = top_child(layer["layer"], model)
        if child is None or layer["stage"] in seen:
            continue
        seen.add(layer["stage"])
        starts[layer["stage"]] = child
    if len(seen) != world or starts != sorted(starts) or len(set(starts)) != world:
        raise SystemExit(f"the forecast's stages {starts} do not cut the model between its top-level children")
    return starts


def schedule(rank: int, world: int, m: int) -> list[tuple[bool, int]]:
    """Stage `rank`'s passes under 1F1B, in order: (backward, micro-batch)."""
    warm = min(world - rank - 1, m)
    order = [(False, j) for j in range(warm)]
    fw, bw = warm, 0
    while bw < m:
        if fw < m:
            order.append((False, fw))
            fw += 1
        order.append((True, bw))
        bw += 1
    return order


def one_f_one_b(rank, world, m, sub, xs, ys, loss_fn, like):
    """One step of this rank's stage under 1F1B: min(world - rank - 1, m) forwards, then one forward and one
    backward in turn, then the remaining backwards (the order gpucast simulates). A forward receives the stage
    before's output (like `like`) and sends its own to the next stage; a backward receives the gradient of its
    output from the next stage and sends its input's gradient back. The last stage's forward ends in the loss (a
    micro-batch's share of the batch's mean). Sends are asynchronous, receives blocking: each direction between
    two stages is one ordered stream of tensors. Returns the seconds spent waiting on the other stages (in
    receives, and for the last sends to leave)."""
    import torch
    import torch.distributed as dist
    last = rank == world - 1
    inputs, outputs, sends = {}, {}, []
    waited = 0.0
    for backward, j in schedule(rank, world, m):
        if not backward:
            if rank == 0:
                inp = xs[j]
            else:
                inp = torch.empty_like(like)
                t0 = time.perf_counter()
                dist.recv(inp, rank - 1)
                waited += time.perf_counter() - t0
                inp.requires_grad_()
            out = sub(inp)
            if last:
                out = loss_fn(out, ys[j]) / m
            else:
                sent = out.detach()
                sends.append((dist.isend(sent, rank + 1), sent))
            inputs[j], outputs[j] = inp, out
        else:
            inp, out = inputs.pop(j), outputs.pop(j)
            if last:
                out.backward()
            else:
                grad = torch.empty_like(out)
                t0 = time.perf_counter()
                dist.recv(grad, rank + 1)
                waited += time.perf_counter() - t0
                out.backward(grad)
            if rank > 0:
                sends.append((dist.isend(inp.grad, rank - 1), inp.grad))
    t0 = time.perf_counter()
    for work, _ in sends:
        work.wait()
    return waited + time.perf_counter() - t0


def worker(args):
    import datetime
    import torch
    import torch.distributed as dist
    import gpucast
    from examples import zoo

    torch.set_num_threads(1)
    torch.ops.gpucast.settle_c_allocator()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("PIPELINE_TIMEOUT_S", "300"))))
    rank, world = dist.get_rank(), dist.get_world_size()
    m = args.micro_batches
    out = {}
    for name in args.cases.split(","):
        batch = BATCH[name]
        model, make_batch, loss_fn = make_case(name)
        link = gpucast.calibrate()
        row = None
        if rank == 0:
            opt = zoo.make_optimizer("adamw", model.parameters())
            step = zoo.make_step(model, opt, loss_fn)
            fc = gpucast.forecast(step, make_batch, batch, model=model, optimizer=opt, target="cpu",
                                  parallel=dict(pp=world, micro_batches=m), link=link)
            t = fc.time
            starts = cuts_of(t, model, world)
            stage_ms = [0.0] * world  # each stage's forecast work: its spans on the forecast's timeline
            for span in t.compute:
                stage_ms[span["stage"]] += span["end_ms"] - span["start_ms"]
            row = {"case": name, "world": world, "batch": batch, "micro_batches": m, "forecast_ms": t.step_ms,
                   "compute_ms": t.compute_ms, "bubble_ms": t.bubble_ms, "pp_comm_ms": t.pp_comm_ms,
                   "other_ms": t.other_ms, "optimizer_ms": t.optimizer_ms, "stage_forecast_ms": stage_ms,
                   "starts": starts}
            del opt, step, fc
        box = [row]
        dist.broadcast_object_list(box, src=0)
        row = box[0]
        starts = row["starts"] + [len(model)]
        sub = torch.nn.Sequential(*list(model)[starts[rank]:starts[rank + 1]])
        inputs, targets = make_batch(batch)
        # The stage's input at one micro-batch (what it receives from the stage before).
        with torch.no_grad():
            x = inputs[: batch // m]
            for child in list(model)[: starts[rank]]:
                x = child(x)
        opt = zoo.make_optimizer("adamw", sub.parameters())
        xs, ys = inputs.chunk(m), targets.chunk(m)

        def pipelined():
            opt.zero_grad(set_to_none=True)
            w = one_f_one_b(rank, world, m, sub, xs, ys, loss_fn, x)
            opt.step()
            return w

        dist.barrier()
        ts, waits = [], []
        for i in range(3 + args.iterations):
            t0 = time.perf_counter()
            w = pipelined()
            if i >= 3:
                ts.append((time.perf_counter() - t0) * 1e3)
                waits.append(w * 1e3)
        every = [torch.zeros(len(ts), dtype=torch.float64) for _ in range(world)]
        dist.all_gather(every, torch.tensor(ts, dtype=torch.float64))
        every_wait = [torch.zeros(len(ts), dtype=torch.float64) for _ in range(world)]
        dist.all_gather(every_wait, torch.tensor(waits, dtype=torch.float64))
        if rank == 0:
            slowest = [max(e[i].item() for e in every) for i in range(len(ts))]
            med, iqr = summary(slowest)
            row.update(measured_ms=round(med, 3), iqr_ms=round(iqr, 3),
                       err_pct=round(100.0 * (row["forecast_ms"] - med) / med, 2),
                       rank_median_ms=[round(statistics.median(e.tolist()), 3) for e in every],
                       rank_wait_ms=[round(statistics.median(e.tolist()), 3) for e in every_wait],
                       rank_busy_ms=[round(statistics.median((a - w).tolist()), 3)
                                     for a, w in zip(every, every_wait)], link=link)
            row["busy_err_pct"] = [round(100.0 * (f - b) / b, 2) for f, b in zip(row["stage_forecast_ms"],
                                                                                   row["rank_busy_ms"])]
            for k in ("forecast_ms", "compute_ms", "bubble_ms", "pp_comm_ms", "other_ms", "optimizer_ms"):
                row[k] = round(row[k], 3)
            row["stage_forecast_ms"] = [round(x, 3) for x in row["stage_forecast_ms"]]
            out[name] = row
        dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(out), flush=True)
    # Leave without the interpreter's teardown: a gloo worker once aborted there ("terminate called without an
    # active exception") after its steps were done.
    sys.stderr.flush()
    os._exit(0)


def run(args) -> list[dict]:
    # glibc keeps the freed top of its heap with --no-heap-trim (as jemalloc and tcmalloc do): no page faults
    env = ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=4000000000:glibc.malloc.mmap_threshold=33554432"}
           if args.no_heap_trim else None)
    res = launch_ranks(__file__, ["--worker", "--cases", args.cases, "--micro-batches", str(args.micro_batches),
                                  "--iterations", str(args.iterations)], args.world, 29541, "pipeline", env)
    return [res[n] for n in args.cases.split(",")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="mlp,gpt")
    ap.add_argument("--world", type=int, default=2, help="pipeline stages, one process each")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-heap-trim", action="store_true",
                    help="run the ranks with glibc's heap trimming off and its mmap threshold at its 32 MiB maximum "
                         "(GLIBC_TUNABLES): freed memory is kept for the next step, as jemalloc and tcmalloc keep "
                         "it, instead of returned and faulted in again")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    rows = median_repeats([run(args) for _ in range(args.repeats)])
    for row in rows:
        name = row["case"]
        print(f"PP x{row['world']} {name:<5} batch {row['batch']:>4} in {row['micro_batches']} micro-batches: measured "
              f"{row['measured_ms']:.2f} ms (IQR {row['iqr_ms']:.2f}; ranks {row['rank_median_ms']}, of which waiting "
              f"{row['rank_wait_ms']}, working {row['rank_busy_ms']}), forecast "
              f"{row['forecast_ms']:.2f} ms (compute {row['compute_ms']:.2f}, bubble {row['bubble_ms']:.2f}, sends "
              f"{row['pp_comm_ms']:.2f}, rest {row['other_ms']:.2f}, optimizer {row['optimizer_ms']:.2f}), error "
              f"{row['err_pct']:+.2f} % (median of {len(row['repeat_err_pct'])} runs: "
              f"{', '.join(f'{e:+.2f}' for e in row['repeat_err_pct'])}); stages cut at top-level children "
              f"{row['starts']}, their work forecast {row['stage_forecast_ms']} ms ({', '.join(f'{e:+.1f}' for e in row['busy_err_pct'])} % against each rank's working time)", flush=True)
    mre = statistics.mean(abs(r["err_pct"]) for r in rows)
    print(f"mean |error| {mre:.2f} % over {len(rows)} cases")
    print(json.dumps({"bench": "pipeline_live", "world": args.world, "micro_batches": args.micro_batches,
                      "no_heap_trim": args.no_heap_trim,
                      "mre_pct": round(mre, 2), "cases": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
