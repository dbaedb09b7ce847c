#include "gpucast/job_hf.h"

#include <algorithm>
#include <initializer_list>
#include <set>

#include <nlohmann/json.hpp>

#include "gpucast/checked.h"
#include "gpucast/error.h"
#include "gpucast/json_input.h"

namespace gpucast {
namespace {

using nlohmann::json;

// A config's sizes are at most 2^24 each (16.7 M: vocabularies, widths, positions, images of real models are far
// below), so that products of two or three stay within int64; products with the job's tokens are checked.
constexpr int64_t kMaxField = int64_t{1} << 24;
constexpr int64_t kMaxBlocks = 1024;  // more blocks than this is not a real model

// Decoders whose MLP is gated (gate and up projections, then down), as transformers builds them.
const std::set<std::string> kGated = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "gemma", "phi3",
                                      "olmo2", "olmoe", "granite"};
const std::set<std::string> kEncoders = {"bert", "roberta"};

struct Reader {
  const json& j;
  std::string source;

  // The first of `keys` present and not null; `fallback` when none is (-1: required).
  int64_t num(std::initializer_list<const char*> keys, int64_t fallback, int64_t min = 1) const {
    for (const char* k : keys) {
      if (!j.contains(k) || j[k].is_null()) continue;
      const std::optional<int64_t> v = json_integer(j[k], min, kMaxField);
      if (!v) {
        GPUCAST_USER_ERROR("{}: field '{}' should be an integer from {} to {}, got {}", source, k, min, kMaxField,
                           j[k].dump().substr(0, 80));
      }
      return *v;
    }
    if (fallback < 0) {
      GPUCAST_USER_ERROR("{}: field '{}' missing (the config's {})", source, *keys.begin(),
                         keys.size() > 1 ? "size under any of its usual names" : "size");
    }
    return fallback;
  }
  bool flag(const char* key, bool fallback) const {
    if (!j.contains(key) || j[key].is_null()) return fallback;
    if (!j[key].is_boolean()) GPUCAST_USER_ERROR("{}: field '{}' should be true or false", source, key);
    return j[key].get<bool>();
  }
  double real(const char* key, double fallback) const {
    if (!j.contains(key) || j[key].is_null()) return fallback;
    if (!j[key].is_number()) GPUCAST_USER_ERROR("{}: field '{}' should be a number", source, key);
    return j[key].get<double>();
  }
};

// Appends layers; every size is checked (gpucast/checked.h).
class Builder {
 public:
  Builder(JobDescription& job, int64_t tokens, int64_t elem) : job_(job), tokens_(tokens), elem_(elem) {}

  static int64_t mul(int64_t a, int64_t b) { return checked_mul(a, b, "config"); }
  // A layer saving `saved` elements per token of the parameter dtype (plus `extra` bytes per sample).
  void add(const std::string& kind, const std::string& name, std::vector<int64_t> dims, int64_t params,
           int64_t saved_per_token, int64_t extra = 0) {
    JobLayer l;
    l.kind = kind;
    l.name = name;
    l.dims = std::move(dims);
    l.params = params;
    l.activation_bytes_per_sample = checked_add(mul(mul(saved_per_token, tokens_), elem_), extra, "config");
    job_.layers.push_back(std::move(l));
  }
  // A linear layer; `saves_input`: false where another layer already saved the same input tensor.
  void linear(const std::string& name, int64_t in, int64_t out, bool bias, bool saves_input = true) {
    add("linear", name, {in, out}, checked_add(mul(in, out), bias ? out : 0, "config"), saves_input ? in : 0);
  }
  int64_t tokens() const { return tokens_; }

 private:
  JobDescription& job_;
  int64_t tokens_, elem_;
};

int64_t element_size(const std::string& dtype) { return dtype == "float32" ? 4 : dtype == "float64" ? 8 : 2; }

// The job's own fields from `settings` (a job description's names), checked as a description's are.
JobDescription read_settings(const json& s, std::string_view source) {
  json whole = s;
  whole["schema_version"] = kJobSchemaVersion;
  whole["layers"] = json::array({json{{"kind", "other"}}});  // a placeholder: the layers come from the config
  JobDescription job = job_from_json(whole.dump(), source);
  job.layers.clear();
  return job;
}

// The number of blocks, refused before any is built where no real model has as many.
int64_t blocks(const Reader& r, std::initializer_list<const char*> keys) {
  const int64_t n = r.num(keys, -1);
  if (n > kMaxBlocks) {
    GPUCAST_USER_ERROR("{}: field '{}' is {}: more blocks than a real model has (at most {})", r.source, *keys.begin(),
                       n, kMaxBlocks);
  }
  return n;
}

// Each head's width where the config does not give head_dim: hidden / heads, which must divide.
int64_t head_size(const Reader& r, int64_t h, int64_t heads) {
  if (heads > h || h % heads != 0) {
    GPUCAST_USER_ERROR("{}: the hidden size {} is not a multiple of the {} attention heads (and no head_dim is given)",
                       r.source, h, heads);
  }
  return h / heads;
}

void decoder_blocks(Builder& b, const Reader& r, const std::string& type, int64_t h, bool gated) {
  const int64_t layers = blocks(r, {"num_hidden_layers", "n_layer", "num_layers"});
  const int64_t heads = r.num({"num_attention_heads", "n_head"}, -1);
  const int64_t kv = r.num({"num_key_value_heads"}, heads);
  const int64_t hd = r.j.contains("head_dim") && !r.j["head_dim"].is_null() ? r.num({"head_dim"}, -1)
                                                                          : head_size(r, h, heads);
  const int64_t ffn = r.num({"intermediate_size", "n_inner"}, gated ? -1 : 4 * h);
  const int64_t experts = r.num({"num_local_experts", "num_experts"}, 0, 0);
  const int64_t top_k = r.num({"num_experts_per_tok"}, std::min<int64_t>(experts, 2), 0);
  const int64_t expert_ffn = r.num({"moe_intermediate_size"}, ffn);
  const int64_t shared_ffn = r.num({"shared_expert_intermediate_size"}, 0, 0);
  const bool qkv_bias = type == "qwen2" || type == "qwen2_moe" || r.flag("attention_bias", false);
  const bool o_bias = r.flag("attention_bias", false);
  const bool mlp_bias = r.flag("mlp_bias", false);
  // Query and key norms: per head dimension (Qwen3), or over all heads' projections (OLMo-2, OLMoE).
  const bool head_norm = type == "qwen3", wide_norm = type == "olmo2" || type == "olmoe";
  if (kv > heads || (heads % kv) != 0) {
    GPUCAST_USER_ERROR("{}: field 'num_key_value_heads' is {}, which does not divide num_attention_heads {}",
                       r.source, kv, heads);
  }
  if (experts > 0 && (top_k < 1 || top_k > experts)) {
    GPUCAST_USER_ERROR("{}: field 'num_experts_per_tok' is {}, expected 1 to the {} experts", r.source, top_k, experts);
  }
  const bool plain_norm = type == "gpt2";  // LayerNorm with a bias; the gated decoders' RMSNorm has a weight only
  const int64_t norm_params = plain_norm ? 2 * h : h;
  const int64_t attn_out = heads * hd;
  for (int64_t i = 0; i < layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    b.add("norm", p + "input_layernorm", {h}, norm_params, h);
    if (type == "gpt2") {
      b.linear(p + "attn.c_attn", h, 3 * h, true);
    } else {
      b.linear(p + "self_attn.q_proj", h, attn_out, qkv_bias);
      b.linear(p + "self_attn.k_proj", h, kv * hd, qkv_bias, false);
      b.linear(p + "self_attn.v_proj", h, kv * hd, qkv_bias, false);
      if (head_norm || wide_norm) {
        b.add("norm", p + "self_attn.q_k_norm", {hd}, head_norm ? 2 * hd : attn_out + kv * hd, attn_out + kv * hd);
      }
    }
    // Scaled dot-product attention saves query, key, value, its output and a float32 logsumexp per head.
    b.add("attention", p + "self_attn", {heads, kv, hd}, 0, 2 * attn_out + 2 * kv * hd, Builder::mul(heads, 4 * b.tokens()));
    b.linear(p + (type == "gpt2" ? "attn.c_proj" : "self_attn.o_proj"), attn_out, h, o_bias || type == "gpt2", false);
    b.add("norm", p + "post_attention_layernorm", {h}, norm_params, h);
    // `copies` MLPs of width f (the experts, as one layer each projection) over `routed` tokens in `copies`: a
    // token goes to top_k of the experts, so together they save top_k times a dense MLP's activations.
    auto mlp = [&](const std::string& name, int64_t f, int64_t copies, int64_t routed) {
      const auto weights = [&](int64_t in, int64_t out, bool bias) {
        return Builder::mul(copies, Builder::mul(in, out) + (bias ? out : 0));
      };
      const std::vector<int64_t> up = copies > 1 ? std::vector<int64_t>{h, f, copies} : std::vector<int64_t>{h, f};
      const std::vector<int64_t> down = copies > 1 ? std::vector<int64_t>{f, h, copies} : std::vector<int64_t>{f, h};
      if (gated) {
        b.add("linear", name + ".gate_proj", up, weights(h, f, mlp_bias), routed * h);
        b.add("linear", name + ".up_proj", up, weights(h, f, mlp_bias), 0);
        b.add("activation", name + ".act_fn", {f}, 0, routed * 3 * f);  // the gate, its activation, the up output
        b.add("linear", name + ".down_proj", down, weights(f, h, mlp_bias), routed * f);
      } else {
        b.add("linear", name + ".c_fc", up, weights(h, f, true), routed * h);
        b.add("activation", name + ".act", {f}, 0, routed * f);
        b.add("linear", name + ".c_proj", down, weights(f, h, true), routed * f);
      }
    };
    if (experts > 0) {
      b.linear(p + "mlp.gate", h, experts, false, false);
      mlp(p + "mlp.experts", expert_ffn, experts, top_k);
      if (shared_ffn > 0) {
        mlp(p + "mlp.shared_expert", shared_ffn, 1, 1);
        b.linear(p + "mlp.shared_expert_gate", h, 1, false, false);
      }
    } else {
      mlp(p + "mlp", ffn, 1, 1);
    }
    if (type == "gpt2" && r.real("resid_pdrop", 0.1) > 0) {
      b.add("dropout", p + "dropout", {h}, 0, 0, Builder::mul(3 * h, b.tokens()));
    }
  }
}

void decoder(JobDescription& job, const Reader& r, const std::string& type) {
  const int64_t h = r.num({"hidden_size", "n_embd"}, -1);
  const int64_t vocab = r.num({"vocab_size"}, -1);
  const int64_t tokens = std::max<int64_t>(1, job.seq_len);
  Builder b(job, tokens, element_size(job.dtype));
  const bool gated = kGated.count(type) > 0;
  b.add("embedding", "model.embed_tokens", {vocab, h}, Builder::mul(vocab, h), 0, 8 * tokens);
  if (type == "gpt2") b.add("embedding", "model.wpe", {r.num({"n_positions"}, 1024), h},
                             Builder::mul(r.num({"n_positions"}, 1024), h), 0, 8 * tokens);
  decoder_blocks(b, r, type, h, gated);
  b.add("norm", "model.norm", {h}, type == "gpt2" ? 2 * h : h, h);
  const bool tied = r.flag("tie_word_embeddings", type == "gpt2" || type == "gemma" || type == "gemma2");
  b.add("linear", "lm_head", {h, vocab}, tied ? 0 : Builder::mul(h, vocab), h);
  // transformers' causal-LM loss upcasts the logits to float32 and log-softmax saves its float32 output.
  b.add("other", "loss", {vocab}, 0, 0, Builder::mul(Builder::mul(vocab, 8), tokens));
  job.family = "transformer-decoder";
  job.input_bytes_per_sample = 16 * tokens;  // input ids and labels (int64)
  job.input_shape = {tokens};
}

void encoder_blocks(Builder& b, const Reader& r, const std::string& prefix, int64_t h, bool sdpa) {
  const int64_t layers = blocks(r, {"num_hidden_layers"});
  const int64_t heads = r.num({"num_attention_heads"}, -1);
  const int64_t hd = head_size(r, h, heads);
  const int64_t ffn = r.num({"intermediate_size"}, 4 * h);
  const double dropout = r.real("hidden_dropout_prob", 0.1), attn_dropout = r.real("attention_probs_dropout_prob", 0.1);
  const int64_t t = b.tokens();
  for (int64_t i = 0; i < layers; ++i) {
    const std::string p = fmt::format("{}.layer.{}.", prefix, i);
    b.linear(p + "attention.query", h, h, true);
    b.linear(p + "attention.key", h, h, true, false);
    b.linear(p + "attention.value", h, h, true, false);
    // Eager attention saves the probabilities (heads x tokens x tokens), their dropout mask and output; SDPA's
    // kernels save a logsumexp instead.
    const int64_t pairs = Builder::mul(Builder::mul(heads, t), t);
    const int64_t eager = Builder::mul(pairs, attn_dropout > 0 ? 2 * 2 + 1 : 2);
    b.add("attention", p + "attention", {heads, hd}, 0, 4 * h, sdpa ? Builder::mul(heads, 4 * t) : eager);
    b.linear(p + "attention.output.dense", h, h, true, false);
    b.add("norm", p + "attention.output.LayerNorm", {h}, 2 * h, h);
    b.linear(p + "intermediate.dense", h, ffn, true);
    b.add("activation", p + "intermediate.act", {ffn}, 0, ffn);
    b.linear(p + "output.dense", ffn, h, true);
    b.add("norm", p + "output.LayerNorm", {h}, 2 * h, h);
    if (dropout > 0) b.add("dropout", p + "dropout", {h}, 0, 0, Builder::mul(2 * h, t));
  }
}

int64_t labels(const Reader& r) {
  if (r.j.contains("id2label") && r.j["id2label"].is_object() && !r.j["id2label"].empty()) {
    return static_cast<int64_t>(r.j["id2label"].size());
  }
  return r.num({"num_labels"}, 2);
}

void encoder(JobDescription& job, const Reader& r, const std::string& type, bool sdpa) {
  const int64_t h = r.num({"hidden_size"}, -1), vocab = r.num({"vocab_size"}, -1);
  const int64_t tokens = std::max<int64_t>(1, job.seq_len);
  Builder b(job, tokens, element_size(job.dtype));
  const int64_t positions = r.num({"max_position_embeddings"}, 512), types = r.num({"type_vocab_size"}, 2);
  if (tokens > positions) {
    GPUCAST_USER_ERROR("{}: seq_len {} is longer than max_position_embeddings {}", r.source, tokens, positions);
  }
  b.add("embedding", type + ".embeddings.word_embeddings", {vocab, h}, Builder::mul(vocab, h), 0, 8 * tokens);
  b.add("embedding", type + ".embeddings.position_embeddings", {positions, h}, Builder::mul(positions, h), 0);
  b.add("embedding", type + ".embeddings.token_type_embeddings", {types, h}, Builder::mul(types, h), 0);
  b.add("norm", type + ".embeddings.LayerNorm", {h}, 2 * h, h);
  encoder_blocks(b, r, type + ".encoder", h, sdpa);
  const int64_t n = labels(r);
  // BERT: a pooler, then the classifier; RoBERTa: the classification head's dense layer and its projection.
  b.linear(type == "bert" ? "bert.pooler.dense" : "classifier.dense", h, h, true, false);
  b.add("linear", type == "bert" ? "classifier" : "classifier.out_proj", {h, n}, Builder::mul(h, n) + n, 0,
        Builder::mul(h, element_size(job.dtype)));
  job.family = "transformer-encoder";
  job.input_bytes_per_sample = 16 * tokens + 8;  // input ids, attention mask, one label (int64)
  job.input_shape = {tokens};
}

void vit(JobDescription& job, const Reader& r, bool sdpa) {
  const int64_t h = r.num({"hidden_size"}, 768), image = r.num({"image_size"}, 224), patch = r.num({"patch_size"}, 16);
  const int64_t channels = r.num({"num_channels"}, 3);
  if (image % patch != 0) {
    GPUCAST_USER_ERROR("{}: field 'patch_size' is {}, which does not divide image_size {}", r.source, patch, image);
  }
  const int64_t tokens = (image / patch) * (image / patch) + 1;
  job.seq_len = 0;
  const int64_t elem = element_size(job.dtype);
  Builder b(job, tokens, elem);
  const int64_t pixels = Builder::mul(Builder::mul(channels, image * image), elem);
  b.add("conv", "vit.embeddings.patch_embeddings.projection", {channels, h, patch, patch},
        Builder::mul(Builder::mul(channels, h), patch * patch) + h, 0, pixels);
  b.add("embedding", "vit.embeddings", {tokens, h}, Builder::mul(tokens, h) + h, 0);
  encoder_blocks(b, r, "vit.encoder", h, sdpa);
  b.add("norm", "vit.layernorm", {h}, 2 * h, h);
  const int64_t n = labels(r);
  b.linear("classifier", h, n, true, false);
  job.family = "vit";
  job.input_bytes_per_sample = pixels + 8;
  job.input_shape = {channels, image, image};
}

}  // namespace

JobDescription job_from_hf_config(std::string_view config, std::string_view settings, std::string_view source) {
  const json c = parse_json_input(config, source);
  if (!c.is_object()) GPUCAST_USER_ERROR("{}: not a transformers config: expected a JSON object", source);
  const json s = parse_json_input(settings, "settings");
  if (!s.is_object()) GPUCAST_USER_ERROR("settings: expected a JSON object of the job's fields");
  json fields = s;
  std::string attn = "sdpa";
  if (fields.contains("attn_implementation")) {
    const json& a = fields["attn_implementation"];
    if (!a.is_string() || (a != "sdpa" && a != "eager")) {
      GPUCAST_USER_ERROR("settings: field 'attn_implementation' should be sdpa or eager, got {}", a.dump().substr(0, 40));
    }
    attn = a.get<std::string>();
    fields.erase("attn_implementation");
  }
  if (!c.contains("model_type") || !c["model_type"].is_string()) {
    GPUCAST_USER_ERROR("{}: field 'model_type' missing (a transformers config.json names its architecture there)",
                       source);
  }
  const std::string type = c["model_type"].get<std::string>();
  JobDescription job = read_settings(fields, "settings");
  const bool text = type != "vit";
  if (text && job.seq_len < 1) GPUCAST_USER_ERROR("settings: field 'seq_len' missing: a {} job needs one", type);
  Reader r{c, std::string(source)};
  if (kGated.count(type) || type == "gpt2") {
    decoder(job, r, type);
  } else if (kEncoders.count(type)) {
    encoder(job, r, type, attn == "sdpa");
  } else if (type == "vit") {
    vit(job, r, attn == "sdpa");
  } else {
    std::string known = "gpt2, vit";
    for (const auto& t : kGated) known += ", " + t;
    for (const auto& t : kEncoders) known += ", " + t;
    GPUCAST_USER_ERROR("{}: model_type '{}' is not one gpucast describes from a config (known: {}); describe the "
                       "model with gpucast.describe(model, make_batch, batch_size) instead", source, type, known);
  }
  // Every count within what a description may hold (job.cpp's checks), as if read from a file.
  return job_from_json(job_to_json(job), source);
}

}  // namespace gpucast
