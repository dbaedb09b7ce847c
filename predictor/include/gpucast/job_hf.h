// gpucast/job_hf.h: a job description from a transformers config.json and the job's settings, without building the
// model: what a scheduler holds before any code runs.
//
// The layers are those transformers builds for the config's model_type (embeddings, per block: norms, the attention's
// projections, the MLP or the experts, the head), with their parameter counts, and each layer's activation bytes
// per sample as the layer saves them for backward at the job's sequence length (its input, in the parameter dtype;
// routed experts see top_k / experts of the tokens). Kinds of model: gated-MLP decoders (llama, mistral, mixtral,
// qwen2, qwen2_moe, qwen3, gemma, phi3, olmo2, olmoe, granite), gpt2, encoders with a sequence-classification head
// (bert, roberta) and vit; anything else is refused with the list.
#pragma once

#include <string>
#include <string_view>

#include "gpucast/job.h"

namespace gpucast {

// `config` is the config.json text; `settings` a JSON object of the job's fields (batch_size and, for text models,
// seq_len, required; dtype, optimizer, grad_accumulation, activation_checkpointing, world_size, strategy, tp, pp,
// micro_batches, target as in a job description). Errors name the file, the field and what was expected.
JobDescription job_from_hf_config(std::string_view config, std::string_view settings,
                                  std::string_view source = "<config>");

}  // namespace gpucast
