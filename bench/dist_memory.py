"""Distributed memory: each rank's measured peak allocator bytes against gpucast's per-rank forecast.

Each case is bench/pipeline_live.py's GPT-style decoder (an nn.Sequential of blocks) or, for the llama_ cases,
transformers' LlamaForCausalLM built from a local config (grouped-query attention, 2 layers, random weights), on
the same tokens; global batch 16, AdamW, 3 training steps, parallelised the way PyTorch's users write it, on 2 or 4
processes of this machine (gloo on loopback, one thread each):
  ddp, ddp_bucket_view   DistributedDataParallel, gradient_as_bucket_view False / True
  zero1                  ZeroRedundancyOptimizer(AdamW) over DDP
  fsdp, fsdp_x4          FSDP2: fully_shard on every top-level child, then on the root (2 / 4 ranks)
  fsdp_no_reshard        the same with reshard_after_forward=False
  fsdp_reshard_2         reshard_after_forward=2 on 4 ranks
  fsdp_bf16              MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)
  fsdp_ckpt              every block under torch.utils.checkpoint (use_reentrant=False), then FSDP2
  fsdp_ckpt_wrapper      every block under checkpoint_wrapper, then FSDP2
  llama_ddp, llama_fsdp, llama_fsdp_x4   Llama: DDP; FSDP2 on each decoder layer, then the root (2 / 4 ranks)
  resnet_ddp, resnet_fsdp   torchvision's ResNet-18 (64 x 64 images, 10 classes): DDP; FSDP2 on its four stages,
                         then the root (2 ranks)
  gpt_tp, llama_tp       tensor parallelism (parallelize_module, 2 ranks sharing the batch): the GPT's MLPs, Llama's
                         attention and MLP (ColwiseParallel / RowwiseParallel, as torchtitan plans a Llama)
  llama_fsdp_tp          FSDP2 x TP on a 2 x 2 mesh (parallelize_module on "tp", fully_shard on "dp"), 4 ranks
  pp_gpipe, pp_1f1b      torch.distributed.pipelining, ScheduleGPipe / Schedule1F1B, the GPT's children cut into 2
                         stages, 4 micro-batches
Every rank measures its own peak independently of gpucast (which the ranks never import): a counting wrapper around
c10's CPU allocator (the C++ extension in COUNTER_SOURCE, built once by this parent process with
torch.utils.cpp_extension.load_inline under ~/.cache/torch_extensions and loaded by the ranks from the built file)
is installed in each rank after the process group is up, just before the model is built. It forwards every
allocation to the allocator it replaces and counts the requested bytes of the blocks it handed out, on every thread
(gloo's worker threads included, whose frees torch.profiler's memory events miss), and the most held at once. A
block allocated before it was installed keeps its original deleter and is never counted, so bytes are counted from
before the model is built, as bench/memory_accuracy.py counts them; the rank's peak is the most held during the 3
steps (and the build before them), end_bytes what is held after the last step. Each case runs --runs times, every
time in fresh processes; per rank the min, median and max over the runs are reported. The
forecast comes from this (parent) process: gpucast.forecast(target="cpu") from single-process probes of the same
model and step, with parallel= describing the job (dp, dp_mode "ddp" / "zero1" / "fsdp" with fsdp_units and
reshard_after_forward, DDP's gradient_as_bucket_view); each rank's forecast is its group's in fc.memory.per_rank.
The tensor-parallel cases are forecast from probes that run as each rank under gpucast.simulated_ranks (one fresh
process per rank: the model built and parallelised as that rank does it, parallel= describing the job); the
pipelines from single-process probes of the whole model with parallel=dict(pp=2, micro_batches=4), the coarse
rule's one number for every stage. A case the parallel= keys cannot describe prints "n/a (not expressible yet)", stays out of the error statistics and
has "forecast": null; mixed precision (param_dtype, reduce_dtype) is forecast and marked approximate. Error = (forecast - largest measured peak of the rank over the runs) /
that peak; the target: every forecast at or above that peak and within 1 %, median |error| <= 0.3 %. Then --confirm
further fresh runs (10; 2 with --quick) of each case: per rank, how far their largest peak lies above the
forecast ("confirm %"; the target: no rank above it by more than 0.5 %). A run whose rank dies or overruns --timeout is killed, reported, and makes
the exit status 1 (--fail-rank R makes rank R exit during step 2, to check that path). Last line: one JSON object.

    python bench/dist_memory.py [--quick] [--cases ddp,fsdp] [--runs 5] [--confirm 10] [--timeout 300]
                                [--fail-rank R] [--measured previous-output.txt]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.utils.checkpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]

GLOBAL_BATCH = 16
STEPS = 3


@dataclasses.dataclass(frozen=True)
class Case:
    world: int
    strategy: str  # "ddp", "zero1", "fsdp", "tp", "fsdp_tp" (a dp x 2 mesh) or "pp"
    options: dict  # how the strategy is set up (see wrap())
    forecastable: bool = True  # whether parallel= can describe it yet
    model: str = "gpt"  # "gpt": pipeline_live.py's decoder; "llama": transformers' LlamaForCausalLM; "resnet"

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each takes GLOBAL_BATCH / dp samples (tensor-parallel ranks share theirs)."""
        return {"tp": 1, "pp": 1, "fsdp_tp": self.world // 2}.get(self.strategy, self.world)


CASES = {
    "ddp": Case(2, "ddp", {"gradient_as_bucket_view": False}),
    "ddp_bucket_view": Case(2, "ddp", {"gradient_as_bucket_view": True}),
    "zero1": Case(2, "zero1", {}),
    "fsdp": Case(2, "fsdp", {"reshard_after_forward": True}),
    "fsdp_x4": Case(4, "fsdp", {"reshard_after_forward": True}),
    "fsdp_no_reshard": Case(2, "fsdp", {"reshard_after_forward": False}),
    "fsdp_reshard_2": Case(4, "fsdp", {"reshard_after_forward": 2}),
    "fsdp_bf16": Case(2, "fsdp", {"reshard_after_forward": True, "bf16": True}),
    "fsdp_ckpt": Case(2, "fsdp", {"reshard_after_forward": True, "checkpoint": "utils"}),
    "fsdp_ckpt_wrapper": Case(2, "fsdp", {"reshard_after_forward": True, "checkpoint": "wrapper"}),
    "llama_ddp": Case(2, "ddp", {"gradient_as_bucket_view": False}, model="llama"),
    "llama_fsdp": Case(2, "fsdp", {"reshard_after_forward": True}, model="llama"),
    "llama_fsdp_x4": Case(4, "fsdp", {"reshard_after_forward": True}, model="llama"),
    "resnet_ddp": Case(2, "ddp", {"gradient_as_bucket_view": False}, model="resnet"),
    "resnet_fsdp": Case(2, "fsdp", {"reshard_after_forward": True}, model="resnet"),
    "gpt_tp": Case(2, "tp", {}),
    "llama_tp": Case(2, "tp", {}, model="llama"),
    "llama_fsdp_tp": Case(4, "fsdp_tp", {}, model="llama"),
    "pp_gpipe": Case(2, "pp", {"schedule": "ScheduleGPipe"}),
    "pp_1f1b": Case(2, "pp", {"schedule": "Schedule1F1B"}),
}
QUICK = ("ddp", "fsdp")
MICRO_BATCHES = 4  # the pipeline cases'



class Llama(torch.nn.Module):
    """transformers' LlamaForCausalLM from a local config (random weights, no hub): the logits of the token ids."""

    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        # Grouped-query attention (4 heads, 2 key-value heads); an intermediate size of 344 rows.
        config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             attn_implementation="sdpa")
        self.lm = LlamaForCausalLM(config)

    def forward(self, tokens):
        return self.lm(input_ids=tokens, use_cache=False).logits


def units(model) -> list:
    """The modules fully_shard is called on before the root: the GPT's top-level children, Llama's decoder layers,
    the ResNet's four stages."""
    if isinstance(model, Llama):
        return list(model.lm.model.layers)
    if hasattr(model, "layer4"):
        return [model.layer1, model.layer2, model.layer3, model.layer4]
    return list(model)


def resnet_case():
    """torchvision's ResNet-18 (random weights, 10 classes) on 64 x 64 images: (model, make_batch, loss_fn)."""
    import torch.nn.functional as F
    import torchvision
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)

    def make_batch(n):
        return torch.randn(n, 3, 64, 64, generator=gen), torch.randint(0, 10, (n,), generator=gen)

    return torchvision.models.resnet18(num_classes=10), make_batch, F.cross_entropy


def tp_plan(model) -> dict:
    """{block: its parallelize_module plan}: Llama's attention (q, k, v column-wise, o row-wise) and MLP (gate and up
    column-wise, down row-wise), as torchtitan plans a Llama; the GPT's MLPs (its packed q/k/v projection cannot be
    split by columns without changing what the attention computes)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    if isinstance(model, Llama):
        plan = {f"self_attn.{n}_proj": ColwiseParallel() for n in "qkv"}
        plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                     "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
        return {layer: plan for layer in model.lm.model.layers}
    from examples import zoo
    return {b: {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()} for b in model if isinstance(b, zoo.Block)}


def build(case: Case):
    """(model, make_batch, loss_fn): the case's model, the GPT's blocks under activation checkpointing if asked."""
    from pipeline_live import make_case
    from examples import zoo

    if case.model == "llama":
        _, make_batch, loss_fn = make_case("gpt")  # the same tokens (512 ids, 64 long) and loss
        return Llama(), make_batch, loss_fn
    if case.model == "resnet":
        return resnet_case()
    model, make_batch, loss_fn = make_case("gpt")
    how = case.options.get("checkpoint")
    for i, child in enumerate(model):
        if how and isinstance(child, zoo.Block):
            if how == "utils":
                model[i] = Checkpointed(child)
            else:
                from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
                model[i] = checkpoint_wrapper(child)
    return model, make_batch, loss_fn


class Checkpointed(torch.nn.Module):
    """A block whose activations are recomputed in backward, as users write it with torch.utils.checkpoint."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def wrap(case: Case, model, loss_fn):
    """(module, optimizer, step): the model parallelised as `case` says, on the default process group (real or
    simulated), and one training step of it."""
    from examples import zoo

    module, opt = _parallelised(case, model)
    if case.strategy == "pp":
        return module, opt, pipeline_step(case, module, opt, loss_fn)
    return module, opt, zoo.make_step(module, opt, loss_fn)


def _parallelised(case: Case, model):
    from examples import zoo

    if case.strategy == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, gradient_as_bucket_view=case.options["gradient_as_bucket_view"])
        return ddp, zoo.make_optimizer("adamw", ddp.parameters())
    if case.strategy == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    if case.strategy == "pp":
        stage = pipeline_stage(model)
        return stage, zoo.make_optimizer("adamw", stage.parameters())
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    world = torch.distributed.get_world_size()
    if case.strategy == "tp":
        mesh = init_device_mesh("cpu", (world,))
        for block, plan in tp_plan(model).items():
            parallelize_module(block, mesh, plan)
        return model, zoo.make_optimizer("adamw", model.parameters())
    if case.strategy == "fsdp_tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        for block, plan in tp_plan(model).items():
            parallelize_module(block, mesh["tp"], plan)
        for child in units(model):
            fully_shard(child, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model, zoo.make_optimizer("adamw", model.parameters())
    mesh = init_device_mesh("cpu", (world,))
    kw = {"mesh": mesh, "reshard_after_forward": case.options["reshard_after_forward"]}
    if case.options.get("bf16"):
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for child in units(model):
        fully_shard(child, **kw)
    fully_shard(model, **kw)
    return model, zoo.make_optimizer("adamw", model.parameters())


def pipeline_stage(model):
    """This rank's stage of the GPT (an nn.Sequential): its children cut in two halves, as a user splits a
    Sequential by hand (stage 0: embedding and the first blocks; stage 1: the rest, the head included)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cut = [len(model) * s // world for s in range(world + 1)]
    return torch.nn.Sequential(*list(model)[cut[rank]:cut[rank + 1]])


def pipeline_step(case: Case, stage_module, opt, loss_fn):
    """One step of torch.distributed.pipelining's schedule over MICRO_BATCHES micro-batches: the first stage feeds
    the tokens, the last computes the loss on the targets; every stage steps its optimizer."""
    from torch.distributed import pipelining
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    stage = pipelining.PipelineStage(stage_module, rank, world, torch.device("cpu"))
    schedule = getattr(pipelining, case.options["schedule"])(stage, n_microbatches=MICRO_BATCHES, loss_fn=loss_fn)

    def step(batch):
        inputs, targets = batch
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(inputs)
        elif rank == world - 1:
            schedule.step(target=targets, losses=[])
        else:
            schedule.step()
        opt.step()

    return step


COUNTER_SOURCE = r"""
#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>

#include <c10/core/CPUAllocator.h>
#include <pybind11/pybind11.h>

namespace {

// Forwards to the CPU allocator it replaces and counts the requested bytes of the blocks it handed out. A block is
// returned with this file's deleter, which looks its size and original deleter up by address; blocks allocated
// before install() keep their own deleter and never reach it.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) {
      return inner;  // zero bytes: nothing to count or free
    }
    c10::Device device = inner.device();
    void* ctx = inner.release_context();
    c10::DeleterFnPtr deleter = inner.get_deleter();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks_[data] = Block{n, ctx, deleter};
    }
    int64_t now = held_.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return {data, data, &CountingAllocator::free_block, device};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return inner_->raw_deleter() ? &CountingAllocator::free_block : nullptr;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    inner_->copy_data(dest, src, count);
  }

  int64_t held() const { return held_.load(); }
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(held_.load()); }

  static CountingAllocator* instance;

 private:
  struct Block {
    size_t bytes;
    void* ctx;
    c10::DeleterFnPtr deleter;
  };

  static void free_block(void* data) {
    Block b{0, nullptr, nullptr};
    {
      std::lock_guard<std::mutex> lock(instance->mutex_);
      auto it = instance->blocks_.find(data);
      if (it != instance->blocks_.end()) {
        b = it->second;
        instance->blocks_.erase(it);
      }
    }
    if (b.deleter == nullptr) {
      // Not handed out here: raw_deleter() used on a block of the allocator it replaced; not counted.
      c10::DeleterFnPtr raw = instance->inner_->raw_deleter();
      if (raw == nullptr) std::abort();
      raw(data);
      return;
    }
    instance->held_.fetch_sub(static_cast<int64_t>(b.bytes));
    b.deleter(b.ctx);
  }

  c10::Allocator* inner_;
  std::atomic<int64_t> held_{0};
  std::atomic<int64_t> peak_{0};
  std::mutex mutex_;
  std::unordered_map<void*, Block> blocks_;
};

CountingAllocator* CountingAllocator::instance = nullptr;

}  // namespace

// Installs the counter once (it is never removed: the ranks end with os._exit).
void install() {
  if (CountingAllocator::instance == nullptr) {
    CountingAllocator::instance = new CountingAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(CountingAllocator::instance, /*priority=*/UINT8_MAX);
  }
}
bool installed() {
  return CountingAllocator::instance != nullptr && c10::GetCPUAllocator() == CountingAllocator::instance;
}
int64_t held() { return CountingAllocator::instance ? CountingAllocator::instance->held() : 0; }
int64_t peak() { return CountingAllocator::instance ? CountingAllocator::instance->peak() : 0; }
void reset_peak() {
  if (CountingAllocator::instance) CountingAllocator::instance->reset_peak();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install);
  m.def("installed", &installed);
  m.def("held", &held);
  m.def("peak", &peak);
  m.def("reset_peak", &reset_peak);
}
"""


def build_counter() -> str:
    """Builds (or finds already built) the allocator counter; the path of its module, for the ranks to load."""
    from torch.utils.cpp_extension import load_inline
    t0 = time.perf_counter()
    mod = load_inline("dist_memory_counter", COUNTER_SOURCE, no_implicit_headers=True, extra_cflags=["-O2"])
    print(f"allocator counter built (or found built) in {time.perf_counter() - t0:.1f} s: {mod.__file__}", flush=True)
    return mod.__file__


def load_counter(path: str):
    """The counter module built by build_counter, loaded from its file (a rank never runs the build)."""
    spec = importlib.util.spec_from_file_location("dist_memory_counter", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def worker(args) -> None:
    """One rank: build, parallelise and train the case, its CPU allocator counted; print its peak as JSON."""
    import torch.distributed as dist
    from examples import zoo

    counter = load_counter(args.counter)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    case = CASES[args.worker]
    counter.install()
    if not counter.installed():
        raise RuntimeError("the allocator counter is not c10's CPU allocator after install()")
    start = counter.held()  # 0: nothing counted yet
    counter.reset_peak()
    model, make_batch, loss_fn = build(case)
    module, opt, step = wrap(case, model, loss_fn)
    del model
    for i in range(STEPS):
        if rank == args.fail_rank and i == 1:
            os._exit(3)  # the failure path's check: a rank that dies mid-run
        b = make_batch(GLOBAL_BATCH // case.dp)
        step(b)
        del b
    print(json.dumps({"rank": rank, "peak_bytes": counter.peak() - start, "end_bytes": counter.held() - start}),
          flush=True)
    dist.destroy_process_group()
    sys.stderr.flush()
    os._exit(0)  # as pipeline_live.py: no interpreter teardown in a gloo worker


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(name: str, args) -> tuple[list[dict] | None, str | None]:
    """One run of a case in `world` fresh processes: (each rank's result, None), or (None, why it failed). A rank
    that exits non-zero gets the others 10 s to end before they are killed; the whole run --timeout seconds."""
    world = CASES[name].world
    env0 = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT / 'python'}:{ROOT}")
    argv = [sys.executable, __file__, "--worker", name, "--counter", args.counter, "--timeout", str(args.timeout),
            "--fail-rank", str(args.fail_rank)]
    with tempfile.TemporaryDirectory(prefix="dist_memory_") as tmp:
        files = [(open(f"{tmp}/{r}.out", "w+"), open(f"{tmp}/{r}.err", "w+")) for r in range(world)]
        procs = [subprocess.Popen(argv, env=dict(env0, RANK=str(r), LOCAL_RANK=str(r)), stdout=o, stderr=e, text=True)
                 for r, (o, e) in enumerate(files)]
        deadline, why = time.monotonic() + args.timeout, None
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed and why is None:
                why = f"rank {failed[0]} exited with code {procs[failed[0]].returncode}"
                deadline = min(deadline, time.monotonic() + 10)
            if time.monotonic() > deadline:
                late = [r for r, p in enumerate(procs) if p.poll() is None]
                why = why or f"ranks {late} still running after {args.timeout} s"
                for r in late:
                    procs[r].kill()
                    procs[r].wait()
                break
            time.sleep(0.2)
        outs = []
        for o, e in files:
            o.seek(0), e.seek(0)
            outs.append((o.read(), e.read()))
            o.close(), e.close()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if why or failed:
        said = [f"rank {r} exited with code {procs[r].returncode}"
                + (f" ({outs[r][1].strip().splitlines()[-1][:200]})" if outs[r][1].strip() else "") for r in failed]
        return None, "; ".join([why] * (why is not None and not why.startswith("rank ")) + said)
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs], None


def peak_stats(peaks: list[int]) -> dict:
    """A rank's min, median and max peak over its runs (none without a run)."""
    if not peaks:
        return {}
    return {"min_bytes": min(peaks), "median_bytes": int(statistics.median(peaks)), "max_bytes": max(peaks)}


def measure(name: str, args, runs: int | None = None) -> dict:
    """--runs (or `runs`) runs of a case: per rank the peaks of every run, their min, median and max; failed runs'
    reasons."""
    runs = args.runs if runs is None else runs
    keys = ("peak_bytes", "end_bytes")
    per_rank = [{k: [] for k in keys} for _ in range(CASES[name].world)]
    errors = []
    for i in range(runs):
        res, why = run_once(name, args)
        if why:
            errors.append(why)
            print(f"  {name} run {i + 1}: FAILED: {why}", flush=True)
            continue
        for r in res:
            for k in keys:
                per_rank[r["rank"]][k].append(r[k])
    ranks = []
    for r, lists in enumerate(per_rank):
        p = lists.pop("peak_bytes")
        ranks.append({"rank": r, "peaks_bytes": p, **peak_stats(p), **lists})
    return {"runs": runs, "failed_runs": errors, "ranks": ranks}


def reused(row: dict, confirm: bool = False) -> dict | None:
    """A previous row's measured runs (or its confirmation runs) in measure()'s form."""
    key = "confirm_peaks_bytes" if confirm else "peaks_bytes"
    if confirm and "confirm_runs" not in row:
        return None
    ranks = []
    for r in row["ranks"]:
        p = r.get(key, [])
        ranks.append({"rank": r["rank"], "peaks_bytes": p, **peak_stats(p), "end_bytes": r.get("end_bytes", [])})
    runs = max((len(r["peaks_bytes"]) for r in ranks), default=0)  # as many as the rank with most (failed runs lack)
    return {"runs": runs, "failed_runs": [] if confirm else row["failed_runs"], "ranks": ranks}


def forecast(name: str) -> tuple[list[int] | None, float]:
    """(gpucast's peak allocated bytes of each rank, from fc.memory.per_rank, or None where parallel= cannot describe
    the case; seconds taken)."""
    import warnings
    import gpucast
    from examples import zoo

    case = CASES[name]
    if not case.forecastable:
        return None, 0.0
    torch.set_num_threads(1)
    if case.strategy in ("tp", "fsdp_tp"):
        return forecast_ranks(name)
    model, make_batch, loss_fn = build(case)
    opt = zoo.make_optimizer("adamw", model.parameters())
    step = zoo.make_step(model, opt, loss_fn)
    parallel = {"dp": case.world, "dp_mode": case.strategy}
    if case.strategy == "pp":
        # The whole model in one process, one micro-batch per step, and the coarse rule's one number for every
        # stage: on a simulated group pipelining cannot infer a stage's shapes; given ahead, they change with every
        # probe's batch, and the probes' structures differ.
        parallel = {"pp": case.world, "micro_batches": MICRO_BATCHES}
    if case.strategy == "ddp":
        parallel["gradient_as_bucket_view"] = case.options["gradient_as_bucket_view"]
    if case.strategy == "fsdp":
        parallel["fsdp_units"] = units(model)  # as the ranks wrap them; the root holds the rest
        parallel["reshard_after_forward"] = case.options["reshard_after_forward"]
        if case.options.get("bf16"):
            parallel.update(param_dtype="bfloat16", reduce_dtype="float32")
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a parallel forecast without a link: the step time's concern, not memory's
        fc = gpucast.forecast(step, make_batch, GLOBAL_BATCH, model=model, optimizer=opt, target="cpu",
                              parallel=parallel, timing_rounds=1)
    if case.strategy == "pp":
        return [fc.memory.peak_allocated_bytes] * case.world, time.perf_counter() - t0
    by_rank = {r: g["peak_allocated_bytes"] for g in fc.memory.per_rank for r in g["ranks"]}
    return [by_rank[r] for r in range(case.world)], time.perf_counter() - t0


def described(case: Case) -> dict:
    """parallel= for a case whose probes run as one of its ranks."""
    if case.strategy == "tp":
        return {"tp": case.world}
    return {"dp": case.dp, "tp": 2, "dp_mode": "fsdp"}


def forecast_ranks(name: str) -> tuple[list[int], float]:
    """forecast()'s answer for a job whose probes run as each of its ranks under gpucast.simulated_ranks, one fresh
    process per rank (one simulated world per process, as simulated_ranks asks)."""
    t0, peaks = time.perf_counter(), []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT / 'python'}:{ROOT}")
    for rank in range(CASES[name].world):
        out = subprocess.run([sys.executable, __file__, "--forecast-rank", f"{name}:{rank}"], env=env, text=True,
                             capture_output=True, timeout=900)
        if out.returncode != 0:
            raise RuntimeError(f"rank {rank}'s forecast: {(out.stderr.strip().splitlines() or ['?'])[-1][:300]}")
        peaks.append(json.loads(out.stdout.strip().splitlines()[-1])["peak_allocated_bytes"])
    return peaks, time.perf_counter() - t0


def forecast_rank(name: str, rank: int) -> None:
    """In a fresh process: the case built and parallelised by wrap() as rank `rank` does it, on a simulated process
    group, and gpucast's forecast of it; its peak printed as JSON."""
    import warnings
    import gpucast

    case = CASES[name]
    torch.set_num_threads(1)
    with gpucast.simulated_ranks(case.world, rank):
        model, make_batch, loss_fn = build(case)
        module, opt, step = wrap(case, model, loss_fn)
        del model
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no link: the step time's concern, not memory's
            fc = gpucast.forecast(step, make_batch, GLOBAL_BATCH, model=module, optimizer=opt, target="cpu",
                                  parallel=described(case), timing_rounds=1)
    print(json.dumps({"rank": rank, "peak_allocated_bytes": fc.memory.peak_allocated_bytes}), flush=True)


def describe(case: Case) -> str:
    text = _describe(case)
    return {"llama": f"Llama (transformers), {text}", "resnet": f"ResNet-18 (torchvision), {text}"}.get(case.model, text)


def _describe(case: Case) -> str:
    o = case.options
    if case.strategy == "ddp":
        return f"DDP, gradient_as_bucket_view={o['gradient_as_bucket_view']}"
    if case.strategy == "zero1":
        return "ZeroRedundancyOptimizer over DDP"
    if case.strategy == "tp":
        return "tensor parallel (parallelize_module: attention and MLP)" if case.model == "llama" else \
            "tensor parallel (parallelize_module: MLP)"
    if case.strategy == "fsdp_tp":
        return f"FSDP2 x tensor parallel ({case.dp} x 2 mesh)"
    if case.strategy == "pp":
        return f"pipelining {case.options['schedule']}, {case.world} stages, {MICRO_BATCHES} micro-batches"
    extra = {"utils": ", torch.utils.checkpoint", "wrapper": ", checkpoint_wrapper"}.get(o.get("checkpoint"), "")
    return f"FSDP2, reshard_after_forward={o['reshard_after_forward']}{', bf16/fp32' if o.get('bf16') else ''}{extra}"


def row_of(name: str, measured: dict, fc: list[int] | None, fc_s: float, confirm: dict | None) -> dict:
    """The case's JSON row: measurement, each rank's forecast and error against its largest peak of the runs, and
    the confirmation runs' largest peak against the forecast."""
    case = CASES[name]
    row = {"case": name, "strategy": describe(case), "world": case.world, "global_batch": GLOBAL_BATCH,
           "steps": STEPS, "forecast": max(fc) if fc else None, "forecast_s": round(fc_s, 1), **measured}
    for r in row["ranks"]:
        if r["peaks_bytes"]:
            r["spread_pct"] = round(100.0 * (r["max_bytes"] - r["min_bytes"]) / r["min_bytes"], 3)
        if fc is None:
            continue
        r["forecast_bytes"] = fc[r["rank"]]
        if r["peaks_bytes"]:
            r["err_pct"] = round(100.0 * (fc[r["rank"]] - r["max_bytes"]) / r["max_bytes"], 3)
        if confirm is not None and confirm["ranks"][r["rank"]]["peaks_bytes"]:
            top = max(confirm["ranks"][r["rank"]]["peaks_bytes"])
            r["confirm_peaks_bytes"] = confirm["ranks"][r["rank"]]["peaks_bytes"]
            r["confirm_over_pct"] = round(100.0 * (top - fc[r["rank"]]) / fc[r["rank"]], 3)
    if confirm is not None:
        row["confirm_runs"] = confirm["runs"]
        row["failed_runs"] = row["failed_runs"] + confirm["failed_runs"]
    return row


def print_row(row: dict) -> None:
    mib = 2 ** 20
    missing = "failed" if "forecast_error" in row else "n/a (not expressible yet)"
    for r in row["ranks"]:
        if not r["peaks_bytes"]:
            print(f"{row['case']:<18} {row['world']:>2} {r['rank']:>4}  no run finished", flush=True)
            continue
        fc = f"{r['forecast_bytes'] / mib:.3f}" if "forecast_bytes" in r else missing
        err = f"{r['err_pct']:+.3f}" if "err_pct" in r else "—"
        over = f"{r['confirm_over_pct']:+.3f}" if "confirm_over_pct" in r else "—"
        print(f"{row['case']:<18} {row['world']:>2} {r['rank']:>4} {r['min_bytes'] / mib:>9.3f} "
              f"{r['median_bytes'] / mib:>9.3f} {r['max_bytes'] / mib:>9.3f} {len(r['peaks_bytes']):>4} {fc:>13} "
              f"{err:>8} {over:>9}   {row['strategy']}", flush=True)


def summary(rows: list[dict]) -> dict:
    try:
        import gpucast
        version = gpucast.__version__
    except Exception as e:  # noqa: BLE001 - the library missing: already reported as failed forecasts
        version = f"not loaded ({type(e).__name__})"
    errs = [r["err_pct"] for row in rows for r in row["ranks"] if "err_pct" in r]
    abs_errs = [abs(e) for e in errs]
    overs = [r["confirm_over_pct"] for row in rows for r in row["ranks"] if "confirm_over_pct" in r]
    return {"bench": "dist_memory", "schema_version": 1,
            "context": {"gpucast": version, "torch": torch.__version__, "device": "cpu",
                        "date": datetime.date.today().isoformat()},
            "median_abs_err_pct": round(statistics.median(abs_errs), 3) if errs else None,
            "max_abs_err_pct": round(max(abs_errs), 3) if errs else None,
            "underestimates": sum(1 for e in errs if e < 0), "compared_ranks": len(errs),
            "confirm_ranks": len(overs), "confirm_max_over_pct": max(overs) if overs else None,
            "confirm_over_0_5_pct": sum(1 for o in overs if o > 0.5),
            "failed_runs": sum(len(row["failed_runs"]) for row in rows),
            "failed_forecasts": sum(1 for row in rows if "forecast_error" in row),
            "cases": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK)} only, 3 runs each")
    ap.add_argument("--runs", type=int, default=5, help="fresh-process runs per case")
    ap.add_argument("--confirm", type=int, default=10,
                    help="further fresh-process runs per case after the forecast, checked against it")
    ap.add_argument("--timeout", type=int, default=300, help="seconds one run may take before its ranks are killed")
    ap.add_argument("--fail-rank", type=int, default=-1, help="this rank exits during step 2 (checks the failure path)")
    ap.add_argument("--measured", help="a previous run's output (its last line): reuse its measured runs and "
                                       "forecast again (the measurements do not depend on gpucast)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--counter", help=argparse.SUPPRESS)
    ap.add_argument("--forecast-rank", help=argparse.SUPPRESS)  # CASE:RANK, in a fresh process
    ap.add_argument("--fake-world", type=int, default=0, help=argparse.SUPPRESS)  # the built counter's file, for the ranks
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.forecast_rank:
        name, rank = args.forecast_rank.split(":")
        forecast_rank(name, int(rank))
        return 0
    names = list(QUICK) if args.quick else args.cases.split(",")
    if args.quick:
        args.runs, args.confirm = 3, 2
    unknown = [n for n in names if n not in CASES]
    if unknown or args.runs < 1 or args.confirm < 0:
        ap.error(f"unknown cases {unknown}; valid: {', '.join(CASES)}" if unknown else "--runs must be at least 1")
    previous = {}
    if args.measured:
        last = [line for line in Path(args.measured).read_text().splitlines() if line.startswith("{")][-1]
        previous = {row["case"]: row for row in json.loads(last)["cases"]}
        names = [n for n in names if n in previous]
    else:
        args.counter = build_counter()
    print(f"{'case':<18} {'ws':>2} {'rank':>4} {'min MiB':>9} {'med MiB':>9} {'max MiB':>9} {'runs':>4} "
          f"{'forecast MiB':>13} {'err %':>8} {'confirm %':>9}   strategy", flush=True)
    rows = []
    for name in names:
        measured = reused(previous[name]) if previous else measure(name, args)
        try:
            fc, fc_s = forecast(name)
        except Exception as e:  # noqa: BLE001 - a forecast that fails is reported beside the measurement
            fc, fc_s, measured["forecast_error"] = None, 0.0, f"{type(e).__name__}: {e}"[:300]
            print(f"  {name}: forecast failed: {measured['forecast_error']}", flush=True)
        confirm = None
        if previous:
            confirm = reused(previous[name], confirm=True)
        elif args.confirm:
            confirm = measure(name, args, args.confirm)
        rows.append(row_of(name, measured, fc, fc_s, confirm))
        print_row(rows[-1])
    out = summary(rows)
    print(f"median |error| {out['median_abs_err_pct']} %, max {out['max_abs_err_pct']} % over "
          f"{out['compared_ranks']} ranks; under-estimates: {out['underestimates']}; confirmation runs: largest "
          f"peak {out['confirm_max_over_pct']} % over the forecast, {out['confirm_over_0_5_pct']} ranks over 0.5 %; "
          f"failed runs: {out['failed_runs']}; failed forecasts: {out['failed_forecasts']}")
    print(json.dumps(out))
    return 1 if out["failed_runs"] or out["failed_forecasts"] else 0


if __name__ == "__main__":
    sys.exit(main())
