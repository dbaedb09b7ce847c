// torch.ops.gpucast.step_correction and step_gnn_weights_path: the step-time graph network (gpucast/step_gnn.h).
// A bad graph (gpucast::UserError) becomes ValueError; a missing or bad weights file is no error: the answer is
// alpha = beta = 1 with a source that says why.
#include <torch/library.h>

#include <nlohmann/json.hpp>

#include "gpucast/error.h"
#include "gpucast/step_gnn.h"
#include "library_init.h"
#include "translate.h"

namespace gpucast {
namespace {

// {"alpha", "beta", "source", "step_ms", "distance", "radius"}: step_ms the graph's step (sum_layers_ms + comm_ms)
// corrected (corrected_step_ms: alpha * sum_layers_ms + beta * comm_ms);
// distance and radius: where the graph lies against the network's training graphs (-1: not computed, no limit).
std::string step_correction_json(const std::string& graph_json, const std::string& weights) {
  return translate("step-graph", [&] {
    const StepGraph g = step_graph_from_json(graph_json, "graph");
    const StepCorrection c = predict_step_correction(g, weights.empty() ? default_step_gnn_weights() : weights);
    const nlohmann::json out = {{"alpha", c.alpha},
                                {"beta", c.beta},
                                {"source", c.source},
                                {"step_ms", corrected_step_ms(g.sum_layers_ms + g.comm_ms, g.sum_layers_ms,
                                                              g.comm_ms, c.alpha, c.beta)},
                                {"distance", c.distance},
                                {"radius", c.radius}};
    return out.dump();
  });
}

}  // namespace
}  // namespace gpucast

void gpucast::register_step_gnn_ops(torch::Library& m) {
  m.def("step_correction(str graph_json, str weights='') -> str", &gpucast::step_correction_json);
  m.def("step_gnn_weights_path() -> str", [] { return gpucast::default_step_gnn_weights(); });
}
