// Job-level model inputs (features, their validation) and the versioned weights file.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <tuple>
#include <algorithm>
#include <string>

#include "gpucast/error.h"
#include "user_error.h"
#include "gpucast/job.h"
#include "gpucast/job_features.h"
#include "gpucast/job_hf.h"
#include "weights_file.h"

namespace gpucast {
namespace {

constexpr auto err = test_util::user_error;

JobDescription small_job() {
  return job_from_json(R"({"schema_version": 1, "family": "mlp", "batch_size": 64, "optimizer": "adamw",
    "grad_accumulation": 2, "input_bytes_per_sample": 3136,
    "layers": [{"kind": "linear", "dims": [784, 256], "params": 200960, "activation_bytes_per_sample": 3136},
               {"kind": "activation", "params": 0, "activation_bytes_per_sample": 1024},
               {"kind": "linear", "dims": [256, 10], "params": 2570}]})");
}

TEST(JobFeatures, NamesMatchWidths) {
  EXPECT_EQ(layer_feature_names().size(), static_cast<size_t>(kLayerFeatures));
  EXPECT_EQ(job_feature_names().size(), static_cast<size_t>(kJobFeatures));
}

TEST(JobFeatures, ExactValues) {
  const JobFeatures f = job_features(small_job());
  ASSERT_EQ(f.layers, 3);
  ASSERT_EQ(f.layer_features.size(), 3u * kLayerFeatures);
  ASSERT_EQ(f.job_features.size(), static_cast<size_t>(kJobFeatures));
  // Layer 0: kind linear (one-hot column 0), log1p(params), log1p(3136), known, log1p(3136 * micro 32),
  // log1p(784), log1p(256), no rest, position 0.
  const float* l0 = f.layer_features.data();
  EXPECT_EQ(l0[0], 1.f);
  for (int k = 1; k < 10; ++k) EXPECT_EQ(l0[k], 0.f);
  EXPECT_FLOAT_EQ(l0[10], std::log1p(200960.f));
  EXPECT_FLOAT_EQ(l0[11], std::log1p(3136.f));
  EXPECT_EQ(l0[12], 1.f);
  EXPECT_FLOAT_EQ(l0[13], std::log1p(3136.f * 32));
  EXPECT_FLOAT_EQ(l0[14], std::log1p(784.f));
  EXPECT_FLOAT_EQ(l0[15], std::log1p(256.f));
  EXPECT_EQ(l0[16], 0.f);
  EXPECT_EQ(l0[17], 0.f);
  // Layer 1: activation (column 6), position 0.5; layer 2: activation size unknown.
  EXPECT_EQ(f.layer_features[kLayerFeatures + 6], 1.f);
  EXPECT_FLOAT_EQ(f.layer_features[kLayerFeatures + 17], 0.5f);
  EXPECT_EQ(f.layer_features[2 * kLayerFeatures + 12], 0.f);
  EXPECT_EQ(f.layer_features[2 * kLayerFeatures + 17], 1.f);
  // Job: batch 64, micro-batch 32, elem bytes 4, adamw one-hot, log2(ga) = 1.
  EXPECT_FLOAT_EQ(f.job_features[0], std::log1p(64.f));
  EXPECT_FLOAT_EQ(f.job_features[1], std::log1p(32.f));
  EXPECT_EQ(f.job_features[4], 4.f);
  EXPECT_EQ(f.job_features[6 + 3], 1.f);  // opt_adamw
  EXPECT_EQ(f.job_features[11], 1.f);     // log2_grad_accumulation
  EXPECT_EQ(f.job_features[14], 1.f);     // strategy_single
  const JobEstimate e = analytical_job_estimate(small_job());
  EXPECT_EQ(f.analytic_bytes, e.bytes);
  EXPECT_DOUBLE_EQ(f.log_analytic_bytes, std::log(static_cast<double>(e.bytes)));
}

// A block repeated back to back is read once, each of its layers with its repeat count; the rest as they are.
TEST(JobFeatures, RepeatedBlocksReadOnce) {
  JobDescription j = small_job();
  const JobLayer emb{"embedding", "emb", {100, 8}, 800, 0};
  const JobLayer a{"linear", "a", {8, 8}, 72, 32}, b{"activation", "b", {}, 0, 32}, c{"norm", "c", {8}, 16, 32};
  j.layers = {emb};
  for (int i = 0; i < 4; ++i) j.layers.insert(j.layers.end(), {a, b, c});
  j.layers.push_back(JobLayer{"linear", "head", {8, 100}, 900, 32});
  const JobFeatures f = job_features(j);
  ASSERT_EQ(f.layers, 5);  // emb, a, b, c (x4), head
  const auto at = [&](int row, int col) { return f.layer_features[static_cast<size_t>(row * kLayerFeatures + col)]; };
  EXPECT_EQ(at(0, 18), 0.f);
  for (int row = 1; row <= 3; ++row) EXPECT_FLOAT_EQ(at(row, 18), std::log1p(3.f));
  EXPECT_EQ(at(4, 18), 0.f);
  EXPECT_FLOAT_EQ(at(4, 17), 1.f);                   // the head's position: the last of 14 layers
  EXPECT_FLOAT_EQ(at(2, 17), 2.f / 13.f);            // b: the second layer of the first block
  EXPECT_EQ(f.analytic_bytes, analytical_job_estimate(j).bytes);  // the estimate reads every layer
  // Layout and target features (version 2).
  j.world_size = 8;
  j.tp = 2;
  j.pp = 2;
  j.micro_batches = 4;
  j.target = "H100-80GB";
  const JobFeatures g = job_features(j);
  EXPECT_FLOAT_EQ(g.job_features[27], 1.f);          // log2_tp
  EXPECT_FLOAT_EQ(g.job_features[29], 2.f);          // log2_micro_batches
  EXPECT_FLOAT_EQ(g.job_features[30], 0.5f);         // first_stage_share: 2 in flight / 4
  EXPECT_FLOAT_EQ(g.job_features[31], std::log1p(81559.f / 1024.f));
  EXPECT_EQ(g.job_features[32], 1.f);
  j.target = "B300";
  EXPECT_EQ(job_features(j).job_features[32], 0.f);  // a GPU the table lacks: unknown, not an error
}

TEST(JobEstimate, NoteCodes) {
  EXPECT_TRUE(analytical_job_estimate(small_job()).notes.empty());
  JobDescription j = small_job();
  j.strategy = "ddp";
  j.world_size = 2;
  j.activation_checkpointing = true;
  j.layers[2].dims.clear();  // a linear layer without dimensions or an activation size
  const JobEstimate e = analytical_job_estimate(j);
  std::vector<std::string> codes;
  for (const Note& n : e.notes) codes.push_back(n.code);
  EXPECT_EQ(codes, (std::vector<std::string>{"ddp-bucket-copy", "activation-size-unknown", "activation-checkpointing"}));
  EXPECT_EQ(e.gradient_bytes, 2 * e.parameter_bytes);  // the buckets' copy
}

TEST(JobFeatures, InputValidation) {
  JobDescription j = small_job();
  j.layers.clear();
  EXPECT_EQ(err([&] { job_features(j); }), "job: field 'layers' is empty: a job needs at least one layer");
  j = small_job();
  j.layers.resize(kMaxJobLayers + 1, j.layers[0]);
  EXPECT_EQ(err([&] { job_features(j); }),
            "job: field 'layers' has 4097 layers; the job-level model reads at most 4096 (leaf modules)");
  j = small_job();
  j.layers[1].kind = "lstm_cell";
  EXPECT_EQ(err([&] { job_features(j); }), "job: field 'layers[1].kind' is \"lstm_cell\", not a known layer kind");
  EXPECT_EQ(err([] {
              job_from_json(R"({"schema_version": 1, "batch_size": 8, "layers": [{"kind": "transformer"}]})");
            }),
            "<job>: field 'layers[0].kind' should be one of activation|attention|conv|dropout|embedding|linear|norm|"
            "other|pool|rnn, got \"transformer\"");
  EXPECT_EQ(err([] {
              job_from_json(R"({"schema_version": 1, "batch_size": 1e30, "layers": [{"kind": "linear"}]})");
            }),
            "<job>: field 'batch_size' should be an integer from 1 to 17592186044416, got 1e+30");
}

// Version 2's layout: states divided by tp x pp, each rank's micro-batch over dp x micro_batches, and 1F1B's first
// stage holding min(pp, micro_batches) micro-batches of its 1/pp of the layers.
TEST(JobEstimate, LayoutDividesStatesAndActivations) {
  JobDescription one = small_job();
  one.grad_accumulation = 1;
  JobDescription split = one;
  split.world_size = 8;
  split.tp = 2;
  split.pp = 2;
  split.micro_batches = 4;
  split.strategy = "ddp";
  EXPECT_EQ(job_dp(split), 2);
  EXPECT_EQ(job_micro_batch(split), 64 / (2 * 4));
  const JobEstimate a = analytical_job_estimate(one), b = analytical_job_estimate(split);
  EXPECT_EQ(b.parameter_bytes, a.parameter_bytes / 4);
  EXPECT_EQ(b.activation_bytes, (3136 + 1024 + 256 * 4) * 8 * 2 / 4);  // 8 samples, 2 in flight, / (tp x pp)
  EXPECT_EQ(b.gradient_bytes, 2 * b.parameter_bytes);  // DDP's bucket copy
  const JobDescription back = job_from_json(job_to_json(split));
  EXPECT_EQ(back.schema_version, 2);
  EXPECT_EQ(std::make_tuple(back.tp, back.pp, back.micro_batches, back.world_size), std::make_tuple(2, 2, 4, 8));
}

// From a transformers config: the layers transformers builds, with their exact parameter counts (checked against
// models built from configs in tests/python/test_job.py); the settings as a description's fields.
TEST(JobFromHfConfig, LlamaLayersAndSettings) {
  const char* config = R"({"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 176,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})";
  const JobDescription j =
      job_from_hf_config(config, R"({"batch_size": 8, "seq_len": 16, "dtype": "bfloat16", "world_size": 4,
                                     "strategy": "fsdp", "tp": 2, "target": "H100-80GB"})", "c.json");
  int64_t params = 0;
  for (const JobLayer& l : j.layers) params += l.params;
  // embeddings 1000x64; per layer: norms 2x64, q 64x64, k and v 64x32, o 64x64, MLP 3x64x176; final norm; head.
  EXPECT_EQ(params, 1000 * 64 + 2 * (2 * 64 + 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 176) + 64 + 64 * 1000);
  EXPECT_EQ(j.family, "transformer-decoder");
  EXPECT_EQ(std::make_tuple(j.batch_size, j.seq_len, j.tp, j.world_size, j.strategy, j.target, j.dtype),
            std::make_tuple(int64_t{8}, int64_t{16}, int64_t{2}, int64_t{4}, std::string("fsdp"),
                            std::string("H100-80GB"), std::string("bfloat16")));
  EXPECT_EQ(j.layers.front().kind, "embedding");
  EXPECT_EQ(j.layers.back().name, "loss");
  EXPECT_EQ(j.layers.back().activation_bytes_per_sample, 1000 * 8 * 16);  // float32 logits and log-softmax
  // Experts as one layer per projection: their tokens are top_k of the experts' share each.
  const JobDescription moe = job_from_hf_config(
      R"({"model_type": "mixtral", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2})",
      R"({"batch_size": 2, "seq_len": 4})");
  const auto gate = std::find_if(moe.layers.begin(), moe.layers.end(),
                                 [](const JobLayer& l) { return l.name == "model.layers.0.mlp.experts.gate_proj"; });
  ASSERT_NE(gate, moe.layers.end());
  EXPECT_EQ(gate->params, 4 * 32 * 64);
  EXPECT_EQ(gate->activation_bytes_per_sample, 2 * 32 * 4 * 4);  // top_k x hidden x tokens x float32
}

TEST(JobFromHfConfig, BadInput) {
  const char* llama = R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
    "num_hidden_layers": 1, "num_attention_heads": 2})";
  EXPECT_EQ(err([&] { job_from_hf_config(llama, R"({"batch_size": 2})", "c.json"); }),
            "settings: field 'seq_len' missing: a llama job needs one");
  EXPECT_EQ(err([&] { job_from_hf_config(llama, R"({"seq_len": 2})", "c.json"); }),
            "settings: missing field 'batch_size'");
  EXPECT_EQ(err([] { job_from_hf_config(R"({"model_type": "t5"})", R"({"batch_size": 2, "seq_len": 2})", "c.json"); })
                .rfind("c.json: model_type 't5' is not one gpucast describes from a config (known: gpt2, vit, gemma", 0),
            0u);
  EXPECT_EQ(err([] {
              job_from_hf_config(R"({"model_type": "llama", "hidden_size": 8})", R"({"batch_size": 2, "seq_len": 2})",
                                 "c.json");
            }),
            "c.json: field 'vocab_size' missing (the config's size)");
  EXPECT_EQ(err([] {
              job_from_hf_config(R"({"model_type": "llama", "vocab_size": 10, "hidden_size": -8})",
                                 R"({"batch_size": 2, "seq_len": 2})", "c.json");
            }),
            "c.json: field 'hidden_size' should be an integer from 1 to 16777216, got -8");
  EXPECT_EQ(err([] { job_from_hf_config("[1]", R"({"batch_size": 2})", "c.json"); }),
            "c.json: not a transformers config: expected a JSON object");
  // Refused before any layer is built; sizes whose products would not fit; heads that do not divide the width.
  const auto llama_with = [](const char* fields, const char* settings = R"({"batch_size": 2, "seq_len": 2})") {
    const std::string config = std::string(R"({"model_type": "llama", "vocab_size": 10, "intermediate_size": 8, )") +
                               fields + "}";
    return err([&] { job_from_hf_config(config, settings, "c.json"); });
  };
  EXPECT_EQ(llama_with(R"("hidden_size": 8, "num_hidden_layers": 1000000, "num_attention_heads": 2)"),
            "c.json: field 'num_hidden_layers' is 1000000: more blocks than a real model has (at most 1024)");
  EXPECT_EQ(llama_with(R"("hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1073741824)"),
            "c.json: field 'num_attention_heads' should be an integer from 1 to 16777216, got 1073741824");
  EXPECT_EQ(llama_with(R"("hidden_size": 6, "num_hidden_layers": 1, "num_attention_heads": 4)"),
            "c.json: the hidden size 6 is not a multiple of the 4 attention heads (and no head_dim is given)");
  EXPECT_EQ(llama_with(R"("hidden_size": 16777216, "num_hidden_layers": 1, "num_attention_heads": 1)",
                       R"({"batch_size": 2, "seq_len": 17592186044416})")
                .rfind("config: ", 0),
            0u);
}

class WeightsFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("gpucast_wf_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    path_ = (dir_ / "w.gcw").string();
    w_.header_json = R"({"model": "test"})";
    w_.tensors.push_back({"a.weight", {2, 3}, {1, 2, 3, 4, 5, 6}});
    w_.tensors.push_back({"a.bias", {2}, {-1.5f, 0.25f}});
    write_weights_file(path_, w_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string bytes() {
    std::ifstream f(path_, std::ios::binary);
    return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
  }
  void put(const std::string& b) {
    std::ofstream f(path_, std::ios::binary | std::ios::trunc);
    f.write(b.data(), static_cast<std::streamsize>(b.size()));
  }
  std::filesystem::path dir_;
  std::string path_;
  WeightsFile w_;
};

const char* kFix = "; retrain with gpucast-train or reinstall gpucast to get the shipped weights";

TEST_F(WeightsFileTest, RoundTrip) {
  const WeightsFile r = read_weights_file(path_);
  EXPECT_EQ(r.header_json, w_.header_json);
  ASSERT_EQ(r.tensors.size(), 2u);
  EXPECT_EQ(r.tensors[0].name, "a.weight");
  EXPECT_EQ(r.tensors[0].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(r.tensors[0].data, w_.tensors[0].data);
  EXPECT_EQ(r.tensors[1].data, w_.tensors[1].data);
  // 8 magic + 4 version + 4 + 17 header + 4 count + (4 + 8 + 4 + 16 + 24) + (4 + 6 + 4 + 8 + 8) + 8 checksum.
  EXPECT_EQ(bytes().size(), 8u + 4 + 4 + 17 + 4 + 56 + 30 + 8);
}

TEST_F(WeightsFileTest, Missing) {
  EXPECT_EQ(err([&] { read_weights_file(path_ + ".nope"); }),
            "cannot open weights file '" + path_ + ".nope': No such file or directory");
}

TEST_F(WeightsFileTest, Truncated) {
  const std::string b = bytes();
  put(b.substr(0, b.size() - 20));
  EXPECT_EQ(err([&] { read_weights_file(path_); }),
            "weights file '" + path_ + "' is corrupt or truncated: its checksum does not match its " +
                std::to_string(b.size() - 20) + " bytes" + kFix);
  put(b.substr(0, 10));
  EXPECT_EQ(err([&] { read_weights_file(path_); }),
            "weights file '" + path_ + "' is truncated: 10 bytes, shorter than any weights file" + kFix);
}

TEST_F(WeightsFileTest, Corrupt) {
  std::string b = bytes();
  b[b.size() - 12] ^= 0x40;  // a bit of the last value
  put(b);
  EXPECT_EQ(err([&] { read_weights_file(path_); }),
            "weights file '" + path_ + "' is corrupt or truncated: its checksum does not match its " +
                std::to_string(b.size()) + " bytes" + kFix);
  put("PK\x03\x04 a zip file, not weights");
  EXPECT_EQ(err([&] { read_weights_file(path_); }),
            "'" + path_ + "' is not a gpucast weights file (it does not start with \"GPUCASTJ\")" + kFix);
}

TEST_F(WeightsFileTest, OtherVersion) {
  std::string b = bytes();
  b[8] = 7;  // format version 7
  put(b);
  EXPECT_EQ(err([&] { read_weights_file(path_); }),
            "weights file '" + path_ + "' has format version 7; this gpucast reads version 1" + kFix);
}

}  // namespace
}  // namespace gpucast
