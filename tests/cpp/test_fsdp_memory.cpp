// FSDP2's rewrite of a hand-made single-process plan (predictor/fsdp_memory.h): exact blocks, order and peaks.
#include <gtest/gtest.h>

#include <map>
#include <tuple>

#include "fsdp_memory.h"

using namespace gpucast;
using namespace gpucast::detail;

namespace {

// Two units and a root without parameters; unit 0 runs first (it takes the model's inputs). Parameter 0: 10 rows
// of 80 bytes in unit 0; parameter 1: 3 rows of 200 bytes in unit 1, which 2 ranks hold as 2 rows each (padded).
// Ops: 0 and 1 the units' forward, 2 the loss (outside), 3 and 4 the units' backward, 5 the optimizer making
// parameter 1's state, 6 a scalar step counter.
FsdpLayout layout(int64_t dp, int64_t reshard, bool gloo) {
  FsdpLayout l;
  l.dp = dp;
  l.units = 3;
  l.root = 2;
  l.reshard_after_forward = reshard;
  l.gloo = gloo;
  l.params = {FsdpParam{0, 800, 10}, FsdpParam{1, 600, 3}};
  l.op_unit = {0, 1, kOutsideUnits, 1, 0, kOutsideUnits, kOutsideUnits};
  l.state_param = {kUnknownParam, kUnknownParam, kUnknownParam, kUnknownParam, kUnknownParam, 1, kScalarState};
  return l;
}

Entry alloc(int64_t ref, int64_t bytes, Category c, Phase ph, int32_t op, int32_t it = 1) {
  return Entry::made(true, ref, bytes, c, ph, op, it);
}
Entry release(int64_t ref, Phase ph, int32_t op, int32_t it = 1) {
  return Entry::made(false, ref, 0, Category::Other, ph, op, it);
}

// One iteration: activations of 100 and 50, the loss (10), the gradients of both parameters, the optimizer's state.
Planned plan(bool second_iteration = false) {
  Planned p;
  p.initial = {800, 600};
  p.initial_category = {Category::Parameter, Category::Parameter};
  auto iteration = [&](int32_t it, int64_t base) {
    p.entries.push_back(alloc(base + 0, 100, Category::Activation, Phase::Forward, 0, it));
    p.entries.push_back(alloc(base + 1, 50, Category::Activation, Phase::Forward, 1, it));
    p.entries.push_back(alloc(base + 2, 10, Category::Other, Phase::Forward, 2, it));
    p.entries.push_back(alloc(base + 3, 600, Category::Gradient, Phase::Backward, 3, it));
    p.entries.push_back(release(base + 1, Phase::Backward, 3, it));
    p.entries.push_back(alloc(base + 4, 800, Category::Gradient, Phase::Backward, 4, it));
    p.entries.push_back(release(base + 0, Phase::Backward, 4, it));
  };
  iteration(1, 0);
  p.entries.push_back(alloc(5, 1200, Category::OptimizerState, Phase::Optimizer, 5));
  p.entries.push_back(alloc(6, 4, Category::OptimizerState, Phase::Optimizer, 6));
  if (second_iteration) {
    // zero_grad(set_to_none=True) frees iteration 1's gradients before the forward.
    p.entries.push_back(release(3, Phase::Optimizer, -1, 2));
    p.entries.push_back(release(4, Phase::Optimizer, -1, 2));
    iteration(2, 100);
  }
  return p;
}

struct Totals {
  int64_t peak = 0, end = 0, forward_peak = 0;
  std::map<int64_t, int64_t> live;  // ref -> bytes at the end
};

Totals replay(const Planned& p) {
  Totals t;
  int64_t now = 0;
  for (int64_t b : p.initial) now += b;
  t.peak = now;
  for (const Entry& e : p.entries) {
    if (e.alloc) {
      t.live[e.ref] = e.bytes;
      now += e.bytes;
      t.peak = std::max(t.peak, now);
      if (e.phase == Phase::Forward) t.forward_peak = std::max(t.forward_peak, now);
    } else if (auto it = t.live.find(e.ref); it != t.live.end()) {
      now -= it->second;
      t.live.erase(it);
    }
  }
  t.end = now;
  return t;
}

// (alloc, bytes) of every entry, frees with 0 bytes.
std::vector<std::pair<bool, int64_t>> shape(const Planned& p) {
  std::vector<std::pair<bool, int64_t>> out;
  for (const Entry& e : p.entries) out.emplace_back(e.alloc, e.alloc ? e.bytes : 0);
  return out;
}

}  // namespace

TEST(FsdpMemory, LocalRowsFollowTorchChunk) {
  EXPECT_EQ(fsdp_local_rows(3, 2, 0), 2);
  EXPECT_EQ(fsdp_local_rows(3, 2, 1), 1);
  EXPECT_EQ(fsdp_local_rows(5, 4, 0), 2);
  EXPECT_EQ(fsdp_local_rows(5, 4, 2), 1);
  EXPECT_EQ(fsdp_local_rows(5, 4, 3), 0);  // torch.chunk gives 3 chunks of 2, 2, 1 rows: the last rank none
  EXPECT_EQ(fsdp_local_rows(1, 8, 0), 1);
  EXPECT_EQ(fsdp_local_rows(1, 8, 1), 0);
}

// Rank 0 of 2, NCCL (no gloo buffers), reshard_after_forward=True: every block in the order FSDP2 makes it.
TEST(FsdpMemory, ReshardAfterForwardOrder) {
  Planned p = plan();
  apply_fsdp(p, layout(2, 1, false), 0);
  // The whole parameters go; each unit's padded shard stays: 10 rows -> 5 x 80, 3 rows -> 2 x 200.
  EXPECT_EQ(p.initial, (std::vector<int64_t>{0, 0, 400, 400}));
  const std::vector<std::pair<bool, int64_t>> expected = {
      {true, 800}, {true, 800},                 // unit 0: all-gather output, then its parameter unsharded
      {true, 100},                              // activation
      {false, 0},                               // unit 0 resharded after forward
      {true, 800}, {false, 0}, {true, 800},     // unit 1 gathered; unit 0's output freed; copy-out
      {true, 50},
      {false, 0}, {false, 0},                   // unit 1 resharded; the root's forward frees the last output
      {true, 10},                               // the loss
      {true, 800}, {true, 800}, {false, 0},     // backward: unit 1 gathered, copied out, output freed
      {true, 800},                              // unit 0 gathered ahead (backward prefetch)
      {true, 600}, {false, 0},                  // unit 1's gradient; an activation freed
      {false, 0}, {true, 800}, {true, 400}, {false, 0},  // post-backward 1: reshard, RS input and output; its last
                                                         // parameter's gradient freed once the reduce-scatter is done
      {true, 800}, {false, 0},                  // unit 0: copy-out of the prefetched output, output freed
      {true, 800}, {false, 0},                  // unit 0's gradient; an activation freed
      // end of backward: unit 0 (no post-backward hook: it takes the inputs) reduce-scattered, unit 1's RS input
      // freed first, the last RS input freed at the end
      {false, 0}, {false, 0}, {true, 800}, {true, 400}, {false, 0}, {false, 0},
      {true, 800}, {true, 4},                   // optimizer state of rank 0's 2 rows of parameter 1; the step
  };
  EXPECT_EQ(shape(p), expected);
  const Totals t = replay(p);
  // The peak, at unit 0's copy-out in backward: shards 800, unit 1's RS output 400 and input 800 (held until the
  // next reduce-scatter), unit 0's gathered output 800 and unsharded parameter 800, the loss 10, an activation 100.
  EXPECT_EQ(t.peak, 800 + 400 + 800 + 800 + 10 + 100 + 800);
  // Left: shards, sharded gradients of both units, state, the loss.
  EXPECT_EQ(t.end, 800 + 400 + 400 + 804 + 10);
}

TEST(FsdpMemory, LastRankHoldsFewerRowsOfState) {
  Planned p0 = plan(), p1 = plan();
  apply_fsdp(p0, layout(2, 1, false), 0);
  apply_fsdp(p1, layout(2, 1, false), 1);
  EXPECT_EQ(replay(p0).end - replay(p1).end, 400);  // parameter 1's state: 2 rows on rank 0, 1 on rank 1
  EXPECT_EQ(p1.initial, p0.initial);                // shards are padded alike
}

// reshard_after_forward=False: no gather in backward, units held from their forward to their post-backward.
TEST(FsdpMemory, NoReshardKeepsUnitsUntilBackward) {
  Planned p = plan();
  apply_fsdp(p, layout(2, 0, false), 0);
  int64_t gathers = 0;
  for (const Entry& e : p.entries) gathers += e.alloc && e.bytes == 800 && e.op == kNone && e.phase == Phase::Backward;
  // Backward allocates only the two reduce-scatter inputs of 800, no all-gather output.
  EXPECT_EQ(gathers, 2);
  const Totals t = replay(p);
  // Forward ends with both units unsharded (1600) and unit 1's output held: shards 800, activations 150.
  EXPECT_EQ(t.forward_peak, 800 + 1600 + 800 + 150);
  Planned resharded = plan();
  apply_fsdp(resharded, layout(2, 1, false), 0);
  EXPECT_EQ(replay(resharded).forward_peak, 800 + 800 + 800 + 150);  // one unit unsharded at a time
  // Unit 1 is resharded after its backward, so the peak is at unit 0's gradient as with resharding: shards 800,
  // unit 0 unsharded 800, loss 10, activation 100, RS input 800, RS output 400, the gradient 800.
  EXPECT_EQ(t.peak, 800 + 800 + 10 + 100 + 800 + 400 + 800);
}

// reshard_after_forward=2 on 4 ranks: after forward each unit keeps a clone of half its unsharded bytes, freed
// when backward gathers it again.
TEST(FsdpMemory, ReshardToFewerRanksKeepsAClone) {
  Planned p = plan();
  apply_fsdp(p, layout(4, 2, false), 0);
  // Padded over 4: 10 rows -> 3 x 4 = 12 rows of 80 = 960; 3 rows -> 1 x 4 = 4 rows of 200 = 800.
  EXPECT_EQ(p.initial, (std::vector<int64_t>{0, 0, 240, 200}));
  int64_t clones = 0;
  for (const Entry& e : p.entries) clones += e.alloc && e.phase == Phase::Forward && (e.bytes == 480 || e.bytes == 400);
  EXPECT_EQ(clones, 2);
  const Totals t = replay(p);
  EXPECT_EQ(t.end, 240 + 200 + 240 + 200 + 1 * 400 + 4 + 10);  // shards, RS outputs, rank 0's 1 row of state
}

// gloo (a CPU target): the device mesh's rank map, a staging copy per all-gather, a clone per reduce-scatter, and
// the worst ordering of gloo's two worker threads: a collective's tensor FSDP dropped is freed when the second
// collective after its own is issued. Collectives here: 1, 2 the forward gathers; 3 unit 1's backward gather; 4 the
// prefetch of unit 0; 5, 6 the reduce-scatters of units 1 and 0.
TEST(FsdpMemory, GlooBuffers) {
  Planned nccl = plan(), gloo = plan();
  apply_fsdp(nccl, layout(2, 1, false), 0);
  apply_fsdp(gloo, layout(2, 1, true), 0);
  EXPECT_EQ(gloo.initial, (std::vector<int64_t>{0, 0, 4 * 2, 400, 400}));
  // 4 gathers each add a staging block and its free; 2 reduce-scatters each a clone, an 8 and a 4-byte scalar, and
  // their frees; but both clones are never freed (no two collectives follow them).
  EXPECT_EQ(gloo.entries.size(), nccl.entries.size() + 4 * 2 + 2 * 6 - 2);
  // The peak: unit 0's clone made while unit 1's clone and unit 0's gathered output (dropped at its copy-out, freed
  // at collective 6's issue, just after) are held. With them: shards and mesh 808, the loss 10, unit 0's RS input
  // 800, both RS outputs 800, and unit 0's gradient 800 (its last parameter's, held until the reduce-scatter is done).
  EXPECT_EQ(replay(gloo).peak, 808 + 10 + 800 + 800 + 800 + 800 + 800 + 800);
  // Unit 0's forward output, dropped at unit 1's copy-out, is freed at collective 3: not in forward. Forward frees:
  // unit 0's block, unit 1's block and the two staging copies.
  int64_t fsdp_frees_in_forward = 0;
  for (const Entry& e : gloo.entries) fsdp_frees_in_forward += !e.alloc && e.phase == Phase::Forward && e.ref >= kFsdpRef;
  EXPECT_EQ(fsdp_frees_in_forward, 4);
  // Freed at once (0 works held), the usual ordering, and after one: no higher.
  Planned at_once = plan(), one = plan();
  apply_fsdp(at_once, layout(2, 1, true), 0, 0);
  apply_fsdp(one, layout(2, 1, true), 0, 1);
  EXPECT_LT(replay(at_once).peak, replay(gloo).peak);
  EXPECT_LE(replay(at_once).peak, replay(one).peak);
  EXPECT_LE(replay(one).peak, replay(gloo).peak);
  EXPECT_EQ(at_once.entries.size(), nccl.entries.size() + 4 * 2 + 2 * 6);  // every block freed
}

// Two iterations: zero_grad frees each unit's sharded gradients (the reduce-scatter output they view), and the
// second iteration ends holding what the first did.
TEST(FsdpMemory, ZeroGradFreesShardedGradients) {
  Planned p = plan(true);
  apply_fsdp(p, layout(2, 1, false), 0);
  const Totals t = replay(p);
  EXPECT_EQ(t.end, 800 + 400 + 400 + 804 + 10 + 10);  // both losses are left (the plan frees neither)
  int64_t sharded_grads = 0;
  for (const auto& [ref, bytes] : t.live) sharded_grads += bytes == 400 && ref >= kFsdpRef;
  EXPECT_EQ(sharded_grads, 2);
}

// One rank (fully_shard on a mesh of 1): no all-gather output, the unsharded blocks copied from the shards.
TEST(FsdpMemory, OneRankGathersNothing) {
  Planned p = plan();
  apply_fsdp(p, layout(1, 1, true), 0);
  int64_t forward_blocks = 0, forward_bytes = 0;
  for (const Entry& e : p.entries) {
    if (e.alloc && e.phase == Phase::Forward && e.ref >= kFsdpRef && e.bytes > 0) ++forward_blocks, forward_bytes += e.bytes;
  }
  EXPECT_EQ(forward_blocks, 2);          // each unit's one parameter, unsharded; no staging copy either
  EXPECT_EQ(forward_bytes, 800 + 600);
  EXPECT_EQ(p.initial, (std::vector<int64_t>{0, 0, 4, 800, 600}));
}

// A root with parameters (here parameter 1's module is the root): not resharded after forward under fully_shard's
// default, so backward does not gather it again; with reshard_after_forward given, it follows it.
TEST(FsdpMemory, RootReshardsOnlyWhenAsked) {
  auto with_root = [](int64_t root_reshard) {
    FsdpLayout l = layout(2, 1, false);
    l.units = 2;
    l.root = 1;
    l.root_reshard_after_forward = root_reshard;
    Planned p = plan();
    apply_fsdp(p, l, 0);
    int64_t backward_gathers = 0;  // the root's all-gather output and its unsharded parameter: 800 each
    for (const Entry& e : p.entries) {
      backward_gathers += e.alloc && e.phase == Phase::Backward && e.ref >= kFsdpRef && e.bytes == 800;
    }
    return backward_gathers;
  };
  // Kept: backward allocates unit 0's prefetched output and copy-out, and the two reduce-scatter inputs.
  EXPECT_EQ(with_root(0), 4);
  // Resharded: the root's output and copy-out as well.
  EXPECT_EQ(with_root(1), 6);
}

// MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) over float32 parameters: the shards cast into
// a flat input before each all-gather, gathered and unsharded in bf16, autograd's gradients and what the float32
// probes computed in bf16, reduce-scattered in float32 (the output already the parameters' dtype: no cast back).
TEST(FsdpMemory, MixedPrecision) {
  FsdpLayout l = layout(2, 1, false);
  l.param_scale = 0.5;
  l.reduce_scale = 1.0;
  l.float_op.assign(l.op_unit.size(), 1);
  Planned p = plan();
  apply_fsdp(p, l, 0);
  const std::vector<std::pair<bool, int64_t>> head = {
      {true, 200}, {true, 400}, {false, 0}, {true, 400},  // unit 0: cast input, output, input freed, unsharded
      {true, 50},                                         // the activation, computed in bf16
  };
  const std::vector<std::pair<bool, int64_t>> all = shape(p);
  EXPECT_EQ((std::vector<std::pair<bool, int64_t>>(all.begin(), all.begin() + 5)), head);
  int64_t grads = 0, scatter_inputs = 0;
  for (const Entry& e : p.entries) {
    grads += e.alloc && e.category == Category::Gradient && e.ref < kFsdpRef ? e.bytes : 0;
    scatter_inputs += e.alloc && e.category == Category::Gradient && e.ref >= kFsdpRef && e.bytes == 800;
  }
  EXPECT_EQ(grads, 300 + 400);     // the probes' 600 and 800 of float32 gradients, in bf16
  EXPECT_EQ(scatter_inputs, 2);    // each unit's reduce-scatter input in float32
  // bf16 reduce over float32 parameters: the output cast back into a float32 block of the shard's size.
  l.reduce_scale = 0.5;
  Planned q = plan();
  apply_fsdp(q, l, 0);
  EXPECT_EQ(q.entries.size(), p.entries.size() + 2 * 2);  // per unit: the float32 block and the bf16 one's free
}
