#include "gpucast/job.h"

#include <algorithm>
#include <set>

#include <nlohmann/json.hpp>

#include "gpucast/checked.h"
#include "gpucast/error.h"
#include "gpucast/json_input.h"
#include "gpucast/note_json.h"
#include "gpucast/parallel.h"

namespace gpucast {
namespace {

using nlohmann::json;

const std::set<std::string> kKinds = {"linear", "conv", "norm", "embedding", "attention", "rnn",
                                      "activation", "pool", "dropout", "other"};
const std::set<std::string> kFamilies = {"mlp", "cnn", "rnn", "transformer-encoder", "transformer-decoder", "vit",
                                         "other"};
const std::set<std::string> kOptimizers = {"sgd", "sgd_momentum", "adam", "adamw", "adafactor", "other"};
const std::set<std::string> kStrategies = {"single", "ddp", "zero1", "zero2", "fsdp"};
constexpr int64_t kMaxCount = int64_t{1} << 44;  // 17.6 trillion: anything above is not a real job

std::string join(const std::set<std::string>& s) {
  std::string out;
  for (const auto& x : s) out += (out.empty() ? "" : "|") + x;
  return out;
}

// JsonFields with the job's own checks; `where` is a field's prefix with its dot ("layers[3].").
class Fields : public JsonFields {
 public:
  using JsonFields::JsonFields;

  const json& at(const json& obj, const char* key, const std::string& where) const {
    if (!obj.contains(key)) missing(where.empty() ? where : where.substr(0, where.size() - 1), key);
    return obj[key];
  }
  int64_t count(const json& obj, const char* key, const std::string& where, int64_t min, int64_t fallback,
                bool required = false) const {
    if (!obj.contains(key)) {
      if (required) at(obj, key, where);
      return fallback;
    }
    const json& v = obj[key];
    const std::optional<int64_t> x = json_integer(v, min, kMaxCount);
    if (!x) fail(where + key, fmt::format("an integer from {} to {}", min, kMaxCount), v);
    return *x;
  }
  std::string choice(const json& obj, const char* key, const std::string& where, const std::set<std::string>& allowed,
                     const std::string& fallback) const {
    if (!obj.contains(key)) return fallback;
    const json& v = obj[key];
    if (!v.is_string() || allowed.count(v.get<std::string>()) == 0) fail(where + key, "one of " + join(allowed), v);
    return v.get<std::string>();
  }
  bool flag(const json& obj, const char* key, const std::string& where) const {
    if (!obj.contains(key)) return false;
    if (!obj[key].is_boolean()) fail(where + key, "true or false", obj[key]);
    return obj[key].get<bool>();
  }
  std::vector<int64_t> ints(const json& obj, const char* key, const std::string& where) const {
    std::vector<int64_t> out;
    if (!obj.contains(key)) return out;
    const json& v = obj[key];
    if (!v.is_array()) fail(where + key, "a list of integers", v);
    for (const json& x : v) {
      const std::optional<int64_t> n = json_integer(x, 0, kMaxCount);
      if (!n) fail(where + key, "a list of integers from 0 to " + std::to_string(kMaxCount), v);
      out.push_back(*n);
    }
    return out;
  }
};

int64_t element_bytes(const std::string& dtype) {
  if (dtype == "float32") return 4;
  if (dtype == "float16" || dtype == "bfloat16") return 2;
  if (dtype == "float64") return 8;
  GPUCAST_USER_ERROR("job: field 'dtype' should be one of float32|float16|bfloat16|float64, got \"{}\"", dtype);
}

}  // namespace

JobDescription job_from_json(std::string_view text, std::string_view source) {
  const json j = parse_json_input(text, source);
  if (!j.is_object()) GPUCAST_USER_ERROR("{}: not a job description: expected a JSON object", source);
  Fields f{std::string(source)};
  JobDescription job;
  const int64_t version = f.count(j, "schema_version", "", 0, 0, true);  // compared whole, then narrowed
  if (version != 1 && version != kJobSchemaVersion) {
    GPUCAST_USER_ERROR("{}: job schema_version {} is not supported (reads versions 1 and {})", source, version,
                       kJobSchemaVersion);
  }
  job.schema_version = kJobSchemaVersion;
  job.family = f.choice(j, "family", "", kFamilies, "other");
  const json& layers = f.at(j, "layers", "");
  if (!layers.is_array()) f.fail("layers", "a list of layers", layers);
  if (layers.empty()) GPUCAST_USER_ERROR("{}: field 'layers' is empty: a job needs at least one layer", source);
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::string w = fmt::format("layers[{}].", i);
    const json& l = layers[i];
    if (!l.is_object()) f.fail(w.substr(0, w.size() - 1), "an object", l);
    JobLayer layer;
    layer.kind = f.choice(l, "kind", w, kKinds, "");
    if (layer.kind.empty()) GPUCAST_USER_ERROR("{}: missing field '{}kind'", source, w);
    if (l.contains("name")) {
      if (!l["name"].is_string()) f.fail(w + "name", "a string", l["name"]);
      layer.name = l["name"].get<std::string>();
    }
    layer.dims = f.ints(l, "dims", w);
    layer.params = f.count(l, "params", w, 0, 0);
    layer.activation_bytes_per_sample = f.count(l, "activation_bytes_per_sample", w, -1, -1);
    job.layers.push_back(std::move(layer));
  }
  job.batch_size = f.count(j, "batch_size", "", 1, 0, true);
  job.seq_len = f.count(j, "seq_len", "", 0, 0);
  job.input_shape = f.ints(j, "input_shape", "");
  job.input_bytes_per_sample = f.count(j, "input_bytes_per_sample", "", 0, 0);
  if (j.contains("dtype")) {
    if (!j["dtype"].is_string()) f.fail("dtype", "a string", j["dtype"]);
    job.dtype = j["dtype"].get<std::string>();
    element_bytes(job.dtype);
  }
  job.autocast = f.flag(j, "autocast", "");
  job.optimizer = f.choice(j, "optimizer", "", kOptimizers, "adamw");
  job.grad_accumulation = f.count(j, "grad_accumulation", "", 1, 1);
  job.activation_checkpointing = f.flag(j, "activation_checkpointing", "");
  job.world_size = f.count(j, "world_size", "", 1, 1);
  job.strategy = f.choice(j, "strategy", "", kStrategies, "single");
  if (version >= 2) {
    job.tp = f.count(j, "tp", "", 1, 1);
    job.pp = f.count(j, "pp", "", 1, 1);
    job.micro_batches = f.count(j, "micro_batches", "", 1, 1);
    if (j.contains("target")) {
      if (!j["target"].is_string() || j["target"].get<std::string>().size() > 64) {
        f.fail("target", "a GPU's name (a string of at most 64 characters)", j["target"]);
      }
      job.target = j["target"].get<std::string>();
    }
  } else {
    for (const char* key : {"tp", "pp", "micro_batches", "target"}) {
      if (j.contains(key)) {
        GPUCAST_USER_ERROR("{}: field '{}' needs schema_version 2 (this description says 1)", source, key);
      }
    }
  }
  job_dp(job);
  if (job.pp > 1 && job.micro_batches < job.pp) {
    GPUCAST_USER_ERROR("{}: field 'micro_batches' is {}, fewer than the {} pipeline stages (pp): every stage needs a "
                       "micro-batch in flight", source, job.micro_batches, job.pp);
  }
  return job;
}

int64_t job_dp(const JobDescription& job) {
  if (job.tp < 1 || job.pp < 1 || job.micro_batches < 1 || job.world_size < 1) {
    GPUCAST_USER_ERROR("job: fields 'world_size', 'tp', 'pp' and 'micro_batches' must be at least 1, got {}, {}, {} "
                       "and {}", job.world_size, job.tp, job.pp, job.micro_batches);
  }
  const int64_t model_ways = checked_mul(job.tp, job.pp, "job");
  if (job.world_size % model_ways != 0) {
    GPUCAST_USER_ERROR("job: field 'world_size' is {}, not a multiple of tp x pp = {} x {}", job.world_size, job.tp,
                       job.pp);
  }
  return job.world_size / model_ways;
}

int64_t job_micro_batch(const JobDescription& job) {
  const int64_t shares = checked_mul(checked_mul(job_dp(job), std::max<int64_t>(1, job.grad_accumulation), "job"),
                                     std::max<int64_t>(1, job.micro_batches), "job");
  return std::max<int64_t>(1, job.batch_size / shares);
}

std::string job_to_json(const JobDescription& job) {
  json layers = json::array();
  for (const JobLayer& l : job.layers) {
    layers.push_back({{"kind", l.kind}, {"name", l.name}, {"dims", l.dims}, {"params", l.params},
                      {"activation_bytes_per_sample", l.activation_bytes_per_sample}});
  }
  return json{{"schema_version", job.schema_version}, {"family", job.family}, {"layers", layers},
              {"batch_size", job.batch_size}, {"seq_len", job.seq_len}, {"input_shape", job.input_shape},
              {"input_bytes_per_sample", job.input_bytes_per_sample}, {"dtype", job.dtype}, {"autocast", job.autocast},
              {"optimizer", job.optimizer}, {"grad_accumulation", job.grad_accumulation},
              {"activation_checkpointing", job.activation_checkpointing}, {"world_size", job.world_size},
              {"strategy", job.strategy}, {"tp", job.tp}, {"pp", job.pp}, {"micro_batches", job.micro_batches},
              {"target", job.target}}
      .dump(1);
}

JobEstimate analytical_job_estimate(const JobDescription& job) {
  JobEstimate e;
  e.method = "analytical";
  const int64_t elem = element_bytes(job.dtype);
  int64_t params = 0, param_tensors = 0;
  // Every sum and product of the description's counts is checked (gpucast/checked.h): each is bounded, their
  // products are not.
  auto add = [](int64_t a, int64_t b) { return checked_add(a, b, "job"); };
  auto mul = [](int64_t a, int64_t b) { return checked_mul(a, b, "job"); };
  for (const JobLayer& l : job.layers) {
    params = add(params, l.params);
    if (l.params > 0) param_tensors += 2;  // weight and (usually) bias
  }
  const int64_t world = job_dp(job);  // the ranks the data-parallel strategy shards over
  const int64_t micro = job_micro_batch(job);
  // Tensor and pipeline parallelism divide the model states by tp x pp (the coarse rule of the trace forecast's
  // model-parallel-rule), as each rank holds its share of every layer or its stage's layers.
  const int64_t model_ways = checked_mul(job.tp, job.pp, "job");  // job_dp checked both
  e.parameter_bytes = mul(params, elem) / model_ways;
  e.gradient_bytes = e.parameter_bytes;
  // Adafactor keeps factored second moments (a row and a column per matrix: torch/optim/_adafactor.py), counted as
  // none here; the learned model corrects.
  const int64_t moments = job.optimizer == "sgd" || job.optimizer == "adafactor" ? 0
                          : job.optimizer == "sgd_momentum"                      ? 1
                                                                                 : 2;
  // 4: Adam's float32 step count per parameter tensor (torch 2.14.1 torch/optim/adam.py:175, optimizer.py:221).
  e.optimizer_bytes = add(mul(moments, e.parameter_bytes), moments == 2 ? mul(4, param_tensors) / model_ways : 0);
  if (job.strategy == "ddp" && world > 1) {
    e.gradient_bytes = mul(e.gradient_bytes, 2);  // the buckets' copy of the gradients
    e.notes.push_back(Note{"ddp-bucket-copy", "DDP: a second copy of the gradients in its buckets"});
  }
  if (job.strategy == "zero1" || job.strategy == "zero2" || job.strategy == "fsdp") e.optimizer_bytes /= world;
  if (job.strategy == "zero2" || job.strategy == "fsdp") e.gradient_bytes /= world;
  if (job.strategy == "fsdp") e.parameter_bytes /= world;
  int64_t act_total = 0, act_max = 0, unknown = 0;
  for (const JobLayer& l : job.layers) {
    int64_t per_sample = l.activation_bytes_per_sample;
    if (per_sample < 0) {
      // From dimensions: a linear layer saves its input (in features per token), others are not derived.
      const int64_t tokens = std::max<int64_t>(1, job.seq_len);
      if (l.kind == "linear" && l.dims.size() >= 2) per_sample = mul(mul(l.dims[0], tokens), elem);
      else {
        ++unknown;
        continue;
      }
    }
    act_total = add(act_total, mul(per_sample, micro));
    act_max = std::max(act_max, mul(per_sample, micro));
  }
  if (unknown > 0) {
    e.notes.push_back(Note{"activation-size-unknown",
                           fmt::format("{} layer(s) without an activation size: not counted", unknown)});
  }
  if (job.activation_checkpointing) {
    // Recomputation keeps one layer's activations plus what crosses checkpoint boundaries (taken as 10 %).
    // 10 %: a chosen share, not measured.
    e.activation_bytes = add(act_max, act_total / 10);
    e.notes.push_back(Note{"activation-checkpointing", "activation checkpointing: one layer's activations plus 10 % of the rest"});
  } else {
    e.activation_bytes = act_total;
  }
  if (model_ways > 1) {
    // The first pipeline stage's in-flight micro-batches of its 1/pp of the layers; tp splits each.
    e.activation_bytes = mul(e.activation_bytes, first_stage_in_flight(job.pp, job.micro_batches)) / model_ways;
  }
  e.input_bytes = mul(job.input_bytes_per_sample, micro);
  e.bytes = add(add(add(add(e.parameter_bytes, e.gradient_bytes), e.optimizer_bytes), e.activation_bytes),
                e.input_bytes);
  e.analytical_bytes = e.bytes;
  return e;
}

std::string job_estimate_to_json(const JobEstimate& e) {
  return json{{"bytes", e.bytes},
              {"reserved_bytes", e.reserved_bytes < 0 ? json(nullptr) : json(e.reserved_bytes)},
              {"analytical_bytes", e.analytical_bytes},
              {"out_of_range", e.out_of_range},
              {"parameter_bytes", e.parameter_bytes},
              {"gradient_bytes", e.gradient_bytes},
              {"optimizer_bytes", e.optimizer_bytes},
              {"activation_bytes", e.activation_bytes},
              {"input_bytes", e.input_bytes},
              {"method", e.method},
              {"notes", e.notes}}
      .dump();
}

}  // namespace gpucast
