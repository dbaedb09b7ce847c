// fsdp_memory.h (internal): what one rank of PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard) holds, as a
// rewrite of the single-process probes' allocation stream (memory_plan.h).
//
// The probes hold every parameter whole, keep autograd's gradients until zero_grad, and make the optimizer state
// of whole parameters. A rank of FSDP2 holds instead (torch 2.14.1, torch/distributed/fsdp/_fully_shard/):
//  - each parameter's shard, padded: dim 0 cut into chunks of ceil(rows / dp) rows, every rank's storage that size
//    (_fsdp_param.py, FSDPParam._init_sharded_param: padded_sharded_size = chunks[0].size());
//  - the optimizer state of its own chunk, unpadded (zeros_like of the sharded DTensor's local tensor): rank r
//    holds min(c, rows - r c) rows of each parameter, so the first ranks hold the most;
//  - per unit (a module given to fully_shard), while it computes: its parameters unsharded (one padded block per
//    parameter, _fsdp_param.py alloc_all_gather_outputs), made from a flat all-gather output of the unit's padded
//    size (_fsdp_collectives.py foreach_all_gather). In forward that output is kept until the next unit has
//    gathered (_fsdp_param_group.py wait_for_unshard: comm_ctx.all_gather_state), and the last one until the root
//    module's forward ends (_fsdp_state.py _post_forward); in backward it goes right after the copy-out;
//  - after a unit's forward, its parameters resharded (reshard_after_forward True: freed; an int n: a clone of
//    1/n of them kept, _fsdp_param.py to_sharded_post_forward; False: kept unsharded until its backward ends).
//    The root unit (the module fully_shard was called on last, holding what no other unit holds) is not resharded
//    after forward when reshard_after_forward was not given (_fsdp_state.py _lazy_init); given, it follows it;
//  - in backward, before a unit's gradients are computed, it is gathered again and the unit before it in forward
//    order is gathered ahead (_fsdp_param_group.py _backward_prefetch: one unit);
//  - after a unit's backward (its post-backward hook, on the gradients of its inputs; a unit whose inputs need no
//    gradient, the first to run and the root, at the end of backward: _fsdp_state.py
//    _root_post_backward_final_callback): its parameters freed, the previous unit's reduce-scatter input freed
//    (reduce_scatter_max_input_buffers 1), a reduce-scatter input of the unit's padded size allocated, autograd's
//    unsharded gradients freed after the copy-in (but the last parameter's, which foreach_reduce's loop variable
//    holds until the reduce-scatter is done), and a reduce-scatter output of the padded shard size allocated, which
//    the sharded gradients view until zero_grad frees them (_fsdp_collectives.py foreach_reduce). The last
//    reduce-scatter input is freed at the end of backward.
//  - optimizer-step temporaries of the sharded tensors: the probes' scaled by the rank's share.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "memory_plan.h"

namespace gpucast::detail {

// A parameter as the probes hold it: whole.
// FsdpLayout::params lists them in the order the model registered them (the order their blocks were allocated):
// a unit's last one is its last.
struct FsdpParam {
  int32_t unit = 0;    // its unit (FsdpLayout::units)
  int64_t bytes = 0;   // whole, in its dtype
  int64_t rows = 1;    // size of dim 0 (1 for a 0-dim parameter)
};

// Refs of the blocks the rewrite adds, from this up: 2^52, a chosen range of its own above the memory forecast's
// others (iteration 2 at 2^40, the cuDNN and cuBLAS workspaces at 2^50, the measured matmul scratch at 2^51).
constexpr int64_t kFsdpRef = int64_t{1} << 52;

// Per op of the reference trace: kOutsideUnits where the op runs outside the model, else its unit.
constexpr int32_t kOutsideUnits = -1;
// FsdpLayout::state_param for optimizer state made from no parameter that is a 0-dim tensor (a step counter): not
// sharded; kUnknownParam: made from no parameter found, sharded evenly.
constexpr int32_t kScalarState = -2;
constexpr int32_t kUnknownParam = -1;

struct FsdpLayout {
  int64_t dp = 1;
  int32_t units = 0;   // units, the root included
  int32_t root = -1;   // the root unit's index
  // 1: reshard after forward (True); 0: keep unsharded until backward (False); n >= 2: keep a 1/n shard after
  // forward. For the units, and for the root (fully_shard's default, not given: 1 and 0).
  int64_t reshard_after_forward = 1;
  int64_t root_reshard_after_forward = 0;
  // The collectives run on gloo (a CPU target), whose own buffers come from the same allocator: a staging copy of
  // each all-gather's output while it is issued (c10d::_allgather_base_ on gloo), and a clone of each
  // reduce-scatter's input for its all-reduce (c10d::_reduce_scatter_base_ on gloo), as traced on torch 2.14.1.
  // NCCL (a GPU target) works in the buffers FSDP gives it; its own buffers are outside the caching allocator.
  bool gloo = false;
  // MixedPrecisionPolicy: bytes of param_dtype and reduce_dtype per byte of the parameters' own dtype (1: none).
  // With param_dtype set, the all-gathers, unsharded parameters and autograd's gradients are in it, and so is what
  // the forward and backward compute: every op making float32 in the probes (float_op) makes param_dtype instead.
  double param_scale = 1.0, reduce_scale = 1.0;
  std::vector<char> float_op;        // per op of the reference trace: its first output is float32
  std::vector<FsdpParam> params;
  std::vector<int32_t> op_unit;      // per op of the reference trace: its unit or kOutsideUnits
  std::vector<int32_t> state_param;  // per op: the parameter the optimizer state it makes shards like, or the above
};

// The rows of a `rows`-row parameter rank `rank` of `dp` holds (torch.chunk's split: ceil(rows / dp) each, the last
// ranks fewer or none).
int64_t fsdp_local_rows(int64_t rows, int64_t dp, int64_t rank);

// ProcessGroupGloo's worker threads (its Options' default). Each takes the next queued collective and lets go of the
// finished one's tensors when it runs again; at worst, with the other thread taking the next collective, two
// collectives after its own.
constexpr int64_t kGlooThreads = 2;

// Rewrites the single-process plan `p` into what rank `rank` of the FSDP2 job holds, in the same order of work. On
// gloo, a collective's tensor that FSDP dropped is freed when the `held_works`-th collective after its own is issued
// (kGlooThreads: the worst ordering; 0: at once, the usual one). An op outside the layout's op_unit counts as
// outside the model.
void apply_fsdp(Planned& p, const FsdpLayout& layout, int64_t rank, int64_t held_works = kGlooThreads);

}  // namespace gpucast::detail
