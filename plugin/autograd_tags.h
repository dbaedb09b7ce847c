// autograd_tags.h (plugin, private): what autograd says each block of an iteration is, from the ops a trace
// observer sees on the training thread (auto mode's observer, and the one a direct start_trace installs).
//
// Parameters are leaf tensors that require grad, read by an op with grad mode on (torch.nn.Parameter, or a LibTorch
// module's registered parameter); gradients are their .grad; inputs are the tensors that require no grad read by
// the first forward op that reads any once a parameter was read (the batch: its first dimension is the batch
// size). Optimizer state is left to the trace's assembly (TraceOptions::optimizer_state_from_phase).
//
// Invariants: one thread touches an instance (the training thread); its methods run inside RecordFunction
// callbacks, dispatch nothing and take no GIL; parameters are held weakly (nothing is kept alive).
#pragma once

#include <cstdint>
#include <unordered_map>

#include <ATen/record_function.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

namespace gpucast {

class AutogradTags {
 public:
  // Forgets the iteration: parameters, forward and inputs.
  void reset();
  // A FUNCTION op outside an optimizer step with grad mode on: notes the parameters it reads; whether it read one.
  bool note_parameters(const at::RecordFunction& fn);
  // The same op, once note_parameters has run (and the caller acted on its answer): the forward has begun when an
  // op read a parameter; its first op that reads tensors without grad tags them as the inputs.
  void note_forward(const at::RecordFunction& fn, bool read_parameter);
  // An op inside an optimizer step: the parameters it reads are the ones the step steps.
  void note_step_op(const at::RecordFunction& fn);
  // Tags the parameters and the gradients held now (at each optimizer step and before the trace stops).
  void tag_model_state();
  // The next forward's inputs are tagged again (a trace of several iterations).
  void expect_inputs() { inputs_tagged_ = false; }
  bool forward_seen() const { return forward_seen_; }
  // Every parameter that holds a gradient was read by an optimizer step since the forward began.
  bool all_stepped() const;
  int64_t batch() const { return batch_; }

 private:
  struct Param {
    c10::weak_intrusive_ptr<c10::TensorImpl> ref;
    bool stepped = false;
  };
  std::unordered_map<const c10::TensorImpl*, Param> params_;
  bool forward_seen_ = false;
  bool inputs_tagged_ = false;
  int64_t batch_ = 1;
};

// The scopes torch.optim records around zero_grad and step (torch/optim/optimizer.py: _zero_grad_profile_name,
// profile_hook_step), which gpucast/gpucast.h records for LibTorch's optimizers too.
inline constexpr const char* kZeroGradScope = "Optimizer.zero_grad#";
inline constexpr const char* kStepScope = "Optimizer.step#";
// Whether a RecordFunction's name (null allowed) begins with `prefix`.
bool name_starts_with(const char* name, const char* prefix);

// A leaf tensor that requires grad: a parameter, as autograd sees one.
bool is_parameter(const at::Tensor& t);

// Calls f on each tensor among an op's inputs (tensor lists included).
template <typename F>
void for_each_tensor(const at::RecordFunction& fn, F&& f) {
  for (const c10::IValue& v : fn.inputs()) {
    if (v.isTensor()) {
      f(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) f(t);
    }
  }
}

}  // namespace gpucast
