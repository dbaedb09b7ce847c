// torch.ops.gpucast.conv_calls, measure_conv_workspaces and measure_matmul_workspaces: the workspaces the target
// batch's kernels take, measured by running the calls the probes made alone at the target's shapes
// (gpucast/workspace_calls.h says which and why). They run in gpucast.forecast on the calling thread, after the
// probes, never inside a tracer callback: each call runs under a trace of its own, and its workspace is what it held
// at its peak above what it held when it returned. Bad arguments (gpucast::UserError) become ValueError with code
// "argument"; out of memory on the device skips a convolution; any other failure propagates (Python then leaves every
// call to the probes' workspaces).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/library.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gpucast/error.h"
#include "gpucast/json_input.h"
#include "gpucast/tracer.h"
#include "gpucast/workspace_calls.h"
#include "library_init.h"
#include "trace_holder.h"
#include "translate.h"

namespace gpucast {
namespace {

using nlohmann::json;
using Workspaces = std::tuple<c10::Dict<std::string, int64_t>, std::vector<std::string>>;

// run() under a trace of its own (memory only, as gpucast.trace(record_shapes=False, device_timing=False)): the
// bytes it held on `device` at its peak above what it held when it returned. What run() returns is held until the
// trace has stopped, so that the result counts as held at the end, not as transient.
template <typename Run>
int64_t transient(const std::string& device, Run&& run) {
  TraceOptions options;
  options.record_shapes = false;
  options.device_timing = false;
  start_trace(options);
  RecordedTrace recorded;
  {
    auto kept = [&] {
      try {
        return run();
      } catch (...) {
        (void)stop_recording();
        throw;
      }
    }();
    recorded = stop_recording();
  }
  return transient_bytes(recorded.trace(), device);
}

// ---- Convolutions ----

// The dtypes a probe's convolution may have recorded; anything else runs in the weight's dtype.
at::ScalarType dtype_or(const std::string& name, at::ScalarType fallback) {
  if (name == "float32") return at::kFloat;
  if (name == "float16") return at::kHalf;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float64") return at::kDouble;
  return fallback;
}

// A torch.nn.ConvNd's geometry, as torch.nn.functional.convNd takes it; `padding_text` ("same", "valid") where the
// module's padding is a string, else `padding`.
struct ConvGeometry {
  std::vector<int64_t> stride, padding, dilation;
  std::string padding_text;
  int64_t groups = 1;
};

ConvGeometry geometry_from_json(const JsonFields& r, const json& j, const std::string& path) {
  ConvGeometry g;
  g.stride = r.get<std::vector<int64_t>>(j, "stride", path);
  if (r.field(j, "padding", path).is_string()) {
    g.padding_text = r.get<std::string>(j, "padding", path);
  } else {
    g.padding = r.get<std::vector<int64_t>>(j, "padding", path);
  }
  g.dilation = r.get<std::vector<int64_t>>(j, "dilation", path);
  g.groups = r.get<int64_t>(j, "groups", path);
  return g;
}

// torch.nn.functional.conv1d, conv2d or conv3d by the input's rank, as the module's forward calls it
// (torch/nn/modules/conv.py, _conv_forward with padding_mode "zeros").
at::Tensor convolve(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                    const ConvGeometry& g) {
  const bool text = !g.padding_text.empty();
  switch (x.dim()) {
    case 3:
      return text ? at::conv1d(x, w, b, g.stride, g.padding_text, g.dilation, g.groups)
                  : at::conv1d(x, w, b, g.stride, g.padding, g.dilation, g.groups);
    case 4:
      return text ? at::conv2d(x, w, b, g.stride, g.padding_text, g.dilation, g.groups)
                  : at::conv2d(x, w, b, g.stride, g.padding, g.dilation, g.groups);
    case 5:
      return text ? at::conv3d(x, w, b, g.stride, g.padding_text, g.dilation, g.groups)
                  : at::conv3d(x, w, b, g.stride, g.padding, g.dilation, g.groups);
    default:
      GPUCAST_USER_ERROR("measure_conv_workspaces: an input of {} dimensions: expected 3 to 5 (conv1d to conv3d)",
                         x.dim());
  }
}

// One module's convolution at `batch` on `device`, forward (no grad) and, where the probes ran it, backward: into
// `out` as "<path>|forward" and "<path>|backward". Out of memory leaves what was measured and skips the rest.
void measure_conv(const std::string& path, const ConvCall& c, int64_t batch, const std::string& device,
                  const at::Tensor& weight, const std::optional<at::Tensor>& bias, const ConvGeometry& g,
                  c10::Dict<std::string, int64_t>& out, std::vector<std::string>& skipped) {
  std::vector<int64_t> shape = c.input_shape;
  shape[0] = batch;
  try {
    at::Tensor x, w;
    std::optional<at::Tensor> b;
    {
      at::NoGradGuard no_grad;
      x = at::zeros(shape, at::TensorOptions().dtype(dtype_or(c.input_dtype, weight.scalar_type())).device(device));
      const at::ScalarType w_dtype = dtype_or(c.weight_dtype, weight.scalar_type());
      w = weight.detach().to(w_dtype);
      if (bias) b = bias->detach().to(w_dtype);
      out.insert_or_assign(path + "|forward", transient(device, [&] { return convolve(x, w, b, g); }));
    }
    if (!c.backward) return;
    x.requires_grad_(c.input_grad);
    w.requires_grad_(true);
    if (b) b->requires_grad_(true);
    at::Tensor y;
    {
      at::AutoGradMode grad(true);
      y = convolve(x, w, b, g);
    }
    const at::Tensor gy = at::ones_like(y);
    std::vector<at::Tensor> inputs;
    for (const at::Tensor* t : {&x, &w, b ? &*b : nullptr}) {
      if (t != nullptr && t->requires_grad()) inputs.push_back(*t);
    }
    out.insert_or_assign(path + "|backward",
                         transient(device, [&] { return torch::autograd::grad({y}, inputs, {gy}); }));
  } catch (const c10::OutOfMemoryError&) {
    skipped.push_back(path + " (out of memory)");
  }
}

// {"<module path>": {"input_shape", "input_dtype", "weight_dtype", "backward", "input_grad"}} in the order the
// modules' first convolution ran (conv_calls in gpucast/workspace_calls.h).
std::string conv_calls_json(const c10::intrusive_ptr<TraceHolder>& probe) {
  return translate("trace-file", [&] {
    nlohmann::ordered_json out = nlohmann::ordered_json::object();
    for (const auto& [path, c] : conv_calls(probe->get())) {
      out[valid_utf8(path)] = {{"input_shape", c.input_shape}, {"input_dtype", c.input_dtype},
                               {"weight_dtype", c.weight_dtype}, {"backward", c.backward},
                               {"input_grad", c.input_grad}};
    }
    return out.dump();
  });
}

// conv_calls_json's text read back, in its order (a JSON object's keys keep the order they were written in).
std::vector<std::pair<std::string, ConvCall>> conv_calls_from_json(const std::string& text) {
  std::vector<std::string> order;
  const json calls = parse_json_input(text, "calls", [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth == 1 && event == json::parse_event_t::key) order.push_back(parsed.get<std::string>());
    return true;
  });
  const JsonFields r("calls");
  if (!calls.is_object()) r.fail("", "an object {module path: call}", calls);
  std::vector<std::pair<std::string, ConvCall>> out;
  for (const std::string& path : order) {
    const json& c = calls.at(path);
    ConvCall call{r.get<std::vector<int64_t>>(c, "input_shape", path), r.get<std::string>(c, "input_dtype", path),
                  r.get<std::string>(c, "weight_dtype", path), r.get<bool>(c, "backward", path),
                  r.get<bool>(c, "input_grad", path)};
    if (call.input_shape.empty()) r.fail(path + ".input_shape", "a shape of at least one dimension", c["input_shape"]);
    out.emplace_back(path, std::move(call));
  }
  return out;
}

// The workspace of each call in `calls` (conv_calls' text) at `batch` on `device`, for the modules Python found to
// be plain torch.nn.ConvNd with zero padding: `modules` ({path: geometry}), `weights` and `biases` by path (a module
// without a bias has none). A call of another module is skipped, each with why.
Workspaces measure_conv_workspaces(const std::string& calls, int64_t batch, const std::string& device,
                                   const std::string& modules, const c10::Dict<std::string, at::Tensor>& weights,
                                   const c10::Dict<std::string, at::Tensor>& biases) {
  return translate("argument", [&] {
    if (batch < 1) GPUCAST_USER_ERROR("measure_conv_workspaces: batch should be at least 1, got {}", batch);
    const json geometry = parse_json_input(modules, "modules");
    const JsonFields r("modules");
    if (!geometry.is_object()) r.fail("", "an object {module path: geometry}", geometry);
    c10::Dict<std::string, int64_t> out;
    std::vector<std::string> skipped;
    for (const auto& [path, c] : conv_calls_from_json(calls)) {
      if (!geometry.contains(path)) {
        skipped.push_back(path + " (not a torch.nn.ConvNd with zero padding)");
        continue;
      }
      if (!weights.contains(path)) GPUCAST_USER_ERROR("measure_conv_workspaces: no weight for {}", path);
      std::optional<at::Tensor> bias;
      if (biases.contains(path)) bias = biases.at(path);
      measure_conv(path, c, batch, device, weights.at(path), bias, geometry_from_json(r, geometry.at(path), path),
                   out, skipped);
    }
    return Workspaces(std::move(out), std::move(skipped));
  });
}

// ---- Matrix multiplies ----

// One distinct call, run once through the dispatcher by name (its default overload) with zeroed operands of its
// shapes and strides, the schema's defaults for its other arguments (as torch.ops.aten.<name>.default(*operands)
// fills them: createStackForSchema, torch/csrc/jit/python/pybind_utils.h): its transient bytes on the CPU.
int64_t run_matmul(const MatmulCall& call) {
  const c10::OperatorHandle& op = c10::Dispatcher::singleton().findSchemaOrThrow(call.name.c_str(), "");
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> operands;
  for (const MatmulOperand& x : call.operands) {
    operands.push_back(at::empty_strided(x.shape, x.strides, at::TensorOptions().dtype(dtype_or(x.dtype, at::kFloat)))
                           .zero_());
  }
  const std::vector<c10::Argument>& args = op.schema().arguments();
  if (args.size() < operands.size()) GPUCAST_USER_ERROR("{}: takes {} arguments, given {}", call.name, args.size(),
                                                        operands.size());
  return transient("cpu", [&] {
    torch::jit::Stack stack(operands.begin(), operands.end());
    for (size_t i = operands.size(); i < args.size(); ++i) {
      if (!args[i].default_value()) GPUCAST_USER_ERROR("{}: argument {} has no default", call.name, args[i].name());
      stack.push_back(*args[i].default_value());
    }
    op.callBoxed(&stack);
    return stack;  // the results
  });
}

// {"<op index in ref>": scratch bytes} for the matrix multiplies of the largest probe `ref` at `batch`, extrapolated
// from `prev` (matmul_calls), each distinct call run once within the limits (plan_matmul_runs); and the calls left
// out, each with why.
Workspaces measure_matmul_workspaces(const c10::intrusive_ptr<TraceHolder>& ref,
                                     const c10::intrusive_ptr<TraceHolder>& prev, int64_t ref_batch,
                                     int64_t prev_batch, int64_t batch, int64_t max_bytes, int64_t max_flops) {
  return translate("argument", [&] {
    MatmulCalls calls = matmul_calls(ref->get(), prev->get(), ref_batch, prev_batch, batch);
    MatmulRuns plan = plan_matmul_runs(calls.calls, max_bytes, max_flops);
    std::map<int64_t, int64_t> bytes;  // by op index
    for (size_t i = 0; i < plan.runs.size(); ++i) {
      const int64_t b = run_matmul(plan.runs[i]);
      for (int64_t op : plan.ops[i]) bytes[op] = b;
    }
    c10::Dict<std::string, int64_t> out;
    for (const auto& [op, b] : bytes) out.insert(std::to_string(op), b);
    std::vector<std::string> skipped = std::move(calls.skipped);
    skipped.insert(skipped.end(), plan.skipped.begin(), plan.skipped.end());
    return Workspaces(std::move(out), std::move(skipped));
  });
}

}  // namespace
}  // namespace gpucast

void gpucast::register_workspace_ops(torch::Library& m) {
  m.def("conv_calls(__torch__.torch.classes.gpucast.Trace probe) -> str", &gpucast::conv_calls_json);
  m.def("measure_conv_workspaces(str calls, int batch, str device, str modules, Dict(str, Tensor) weights, "
        "Dict(str, Tensor) biases) -> (Dict(str, int), str[])",
        &gpucast::measure_conv_workspaces);
  m.def(fmt::format("measure_matmul_workspaces(__torch__.torch.classes.gpucast.Trace ref, "
                    "__torch__.torch.classes.gpucast.Trace prev, int ref_batch, int prev_batch, int batch, "
                    "int max_bytes={}, int max_flops={}) -> (Dict(str, int), str[])",
                    gpucast::kMaxMatmulOperandBytes, gpucast::kMaxMatmulFlops)
            .c_str(),
        &gpucast::measure_matmul_workspaces);
}
