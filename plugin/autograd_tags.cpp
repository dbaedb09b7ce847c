// Categories from autograd's metadata (autograd_tags.h).
#include "autograd_tags.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "gpucast/storage_identity.h"
#include "gpucast/tracer.h"

namespace gpucast {
namespace {

int64_t block_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return 0;
  return static_cast<int64_t>(storage_identity(t.storage()));
}

void tag_by_device(const std::map<std::string, std::vector<int64_t>>& blocks, Category category) {
  for (const auto& [device, ptrs] : blocks) tag_blocks(ptrs, device, category);
}

}  // namespace

bool name_starts_with(const char* name, const char* prefix) {
  return name != nullptr && std::strncmp(name, prefix, std::strlen(prefix)) == 0;
}

bool is_parameter(const at::Tensor& t) { return t.defined() && t.requires_grad() && t.is_leaf(); }

void AutogradTags::reset() {
  params_.clear();
  forward_seen_ = false;
  inputs_tagged_ = false;
  batch_ = 1;
}

bool AutogradTags::note_parameters(const at::RecordFunction& fn) {
  bool read = false;
  for_each_tensor(fn, [&](const at::Tensor& t) {
    if (!is_parameter(t)) return;
    read = true;
    if (params_.find(t.unsafeGetTensorImpl()) == params_.end()) {
      params_.emplace(t.unsafeGetTensorImpl(), Param{c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()), false});
    }
  });
  return read;
}

// (Python's F.linear reads the batch in its first op; LibTorch's transposes the weight first.)
void AutogradTags::note_forward(const at::RecordFunction& fn, bool read_parameter) {
  forward_seen_ = forward_seen_ || read_parameter;
  if (!forward_seen_ || inputs_tagged_) return;
  std::map<std::string, std::vector<int64_t>> inputs;
  for_each_tensor(fn, [&](const at::Tensor& t) {
    if (!t.defined() || t.requires_grad()) return;
    if (!inputs_tagged_ && t.dim() > 0) batch_ = std::max<int64_t>(1, t.size(0));
    inputs_tagged_ = true;
    if (const int64_t b = block_of(t)) inputs[t.device().str()].push_back(b);
  });
  tag_by_device(inputs, Category::Input);
}

void AutogradTags::note_step_op(const at::RecordFunction& fn) {
  for_each_tensor(fn, [&](const at::Tensor& t) {
    auto it = params_.find(t.unsafeGetTensorImpl());
    if (it != params_.end()) it->second.stepped = true;
  });
}

void AutogradTags::tag_model_state() {
  std::map<std::string, std::vector<int64_t>> params, grads;
  for (auto& [impl, p] : params_) {
    c10::intrusive_ptr<c10::TensorImpl> strong = p.ref.lock();
    if (!strong) continue;
    const at::Tensor t(std::move(strong));
    if (const int64_t b = block_of(t)) params[t.device().str()].push_back(b);
    const at::Tensor& g = t.grad();
    if (const int64_t b = block_of(g)) grads[g.device().str()].push_back(b);
  }
  tag_by_device(params, Category::Parameter);
  tag_by_device(grads, Category::Gradient);
}

bool AutogradTags::all_stepped() const {
  if (!forward_seen_) return false;
  for (const auto& [impl, p] : params_) {
    if (p.stepped) continue;
    c10::intrusive_ptr<c10::TensorImpl> strong = p.ref.lock();
    if (!strong) continue;
    const at::Tensor t(std::move(strong));
    if (t.grad().defined()) return false;
  }
  return true;
}

}  // namespace gpucast
