// gpucast-train: trains the job-level memory model (gpucast/job_model.h) from JSON Lines files of labelled jobs, and
// (subcommand step-gnn) the step-time graph network (gpucast/step_gnn.h) from JSON Lines files of step graphs.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpucast/error.h"
#include "gpucast/json_input.h"
#include "gpucast/job_model.h"
#include "gpucast/step_gnn.h"

namespace {

const char* kUsage =
    "usage: gpucast-train --train FILE --val FILE --out WEIGHTS [options]\n"
    "       gpucast-train step-gnn --train FILE --val FILE --out WEIGHTS [options]   (see step-gnn --help)\n"
    "Trains gpucast's job-level memory model (BiGRU-optimized Transformer) and writes its weights.\n"
    "FILE: JSON Lines, one labelled job per line: {\"job\": <job description>, \"label_bytes\": <peak allocated\n"
    "      bytes>, \"label_reserved_bytes\": <peak reserved bytes, or null where not known>}\n"
    "options:\n"
    "  --seed N        random seed (default 0)\n"
    "  --epochs N      most epochs (default 300)\n"
    "  --patience N    stop after N epochs without a better validation loss (default 30)\n"
    "  --batch N       jobs per step (default 32)\n"
    "  --lr X          AdamW learning rate (default 0.002)\n"
    "  --d-model N     width of the projection and of each GRU direction (default 32)\n"
    "  --layers N      Transformer encoder layers (default 2)\n"
    "  --threads N     torch CPU threads (default: torch's choice)\n"
    "  --verbose       one line per epoch on stderr\n";

const char* kStepGnnUsage =
    "usage: gpucast-train step-gnn --train FILE --val FILE --out WEIGHTS [options]\n"
    "Trains gpucast's step-time graph network (ScaleDL's GNN: step_ms = alpha * sum_layers_ms + beta * comm_ms) and\n"
    "writes its weights.\n"
    "FILE: JSON Lines, one step graph per line, measured_ms required: {\"family\", \"model\", \"global\": {...},\n"
    "      \"nodes\": [...], \"edges\": [[src, dst, bytes], ...], \"sum_layers_ms\", \"comm_ms\", \"measured_ms\"}\n"
    "options:\n"
    "  --seed N        random seed (default 0)\n"
    "  --epochs N      most epochs (default 400)\n"
    "  --patience N    stop after N epochs without a better validation loss (default 40)\n"
    "  --batch N       graphs per step (default 32)\n"
    "  --lr X          AdamW learning rate (default 0.003)\n"
    "  --d-model N     width of the node and graph embeddings (default 32)\n"
    "  --members N     networks in the ensemble, each from its own seed (default 5, at most 32)\n"
    "  --rotate-val    member k stops early on the k-th tenth of the training and validation graphs pooled and\n"
    "                  trains on the rest (default: every member trains on --train and stops on --val)\n"
    "  --threads N     torch CPU threads (default: torch's choice)\n"
    "  --verbose       one line per epoch on stderr\n";

std::vector<gpucast::TrainingJob> read_jobs(const std::string& path) {
  std::ifstream f(path);
  if (!f) GPUCAST_USER_ERROR("gpucast-train: cannot open '{}'", path);
  std::vector<gpucast::TrainingJob> out;
  std::string line;
  for (int n = 1; std::getline(f, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(n);
    const nlohmann::json row = gpucast::parse_json_input(line, where);
    if (!row.is_object() || !row.contains("job") || !row.contains("label_bytes") ||
        !row["label_bytes"].is_number_integer()) {
      GPUCAST_USER_ERROR("{}: expected {{\"job\": {{...}}, \"label_bytes\": <integer>}}", where);
    }
    int64_t reserved = 0;
    if (row.contains("label_reserved_bytes") && !row["label_reserved_bytes"].is_null()) {
      if (!row["label_reserved_bytes"].is_number_integer()) {
        GPUCAST_USER_ERROR("{}: field 'label_reserved_bytes' should be an integer or null", where);
      }
      reserved = row["label_reserved_bytes"].get<int64_t>();
    }
    out.push_back({gpucast::job_from_json(row["job"].dump(), where), row["label_bytes"].get<int64_t>(), reserved});
  }
  if (out.empty()) GPUCAST_USER_ERROR("gpucast-train: '{}' holds no jobs", path);
  return out;
}

long number(const std::string& flag, const char* text) {
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || v < 0) GPUCAST_USER_ERROR("gpucast-train: {} expects a whole number >= 0, got '{}'", flag, text);
  return v;
}

std::vector<gpucast::StepGraph> read_graphs(const std::string& path) {
  std::ifstream f(path);
  if (!f) GPUCAST_USER_ERROR("gpucast-train step-gnn: cannot open '{}'", path);
  std::vector<gpucast::StepGraph> out;
  std::string line;
  for (int n = 1; std::getline(f, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(n);
    out.push_back(gpucast::step_graph_from_json(line, where));
    if (out.back().measured_ms <= 0) {
      GPUCAST_USER_ERROR("{}: measured_ms: missing; training needs the measured time", where);
    }
  }
  if (out.empty()) GPUCAST_USER_ERROR("gpucast-train step-gnn: '{}' holds no graphs", path);
  return out;
}

double positive_number(const std::string& flag, const char* text) {
  char* end = nullptr;
  const double v = std::strtod(text, &end);
  if (end == text || *end != '\0' || !(v > 0)) {
    GPUCAST_USER_ERROR("gpucast-train: {} expects a number > 0, got '{}'", flag, text);
  }
  return v;
}

// The arguments both subcommands take, from argv[first] on; `extra` takes a subcommand's own flags (false: not
// one of them). --lr is kept as written: each subcommand reads it its own way. Prints `usage` for -h/--help.
struct TrainArgs {
  std::string train, val, out;
  const char* lr = nullptr;
  bool help = false;
};

template <class Options>
TrainArgs parse_train_args(int argc, char** argv, int first, const char* who, const char* usage, Options& o,
                           const std::function<bool(const std::string&, const std::function<const char*()>&)>& extra) {
  TrainArgs r;
  for (int i = first; i < argc; ++i) {
    const std::string a = argv[i];
    const std::function<const char*()> value = [&]() -> const char* {
      if (i + 1 >= argc) GPUCAST_USER_ERROR("{}: {} needs a value", who, a);
      return argv[++i];
    };
    if (a == "--train") r.train = value();
    else if (a == "--val") r.val = value();
    else if (a == "--out") r.out = value();
    else if (a == "--seed") o.seed = static_cast<uint64_t>(number(a, value()));
    else if (a == "--epochs") o.max_epochs = number(a, value());
    else if (a == "--patience") o.patience = number(a, value());
    else if (a == "--batch") o.batch_size = std::max(1L, number(a, value()));
    else if (a == "--lr") r.lr = value();
    else if (a == "--threads") o.threads = static_cast<int>(number(a, value()));
    else if (a == "--verbose") o.verbose = true;
    else if (a == "-h" || a == "--help") {
      std::fputs(usage, stdout);
      r.help = true;
      return r;
    } else if (!extra(a, value)) {
      GPUCAST_USER_ERROR("{}: unknown argument '{}'\n{}", who, a, usage);
    }
  }
  if (r.train.empty() || r.val.empty() || r.out.empty()) {
    GPUCAST_USER_ERROR("{}: --train, --val and --out are required\n{}", who, usage);
  }
  return r;
}

int step_gnn_main(int argc, char** argv) {
  gpucast::StepGnnTrainOptions o;
  const TrainArgs args = parse_train_args(argc, argv, 2, "gpucast-train step-gnn", kStepGnnUsage, o,
                                          [&](const std::string& a, const std::function<const char*()>& value) {
                                            if (a == "--d-model") o.d_model = std::max(1L, number(a, value()));
                                            else if (a == "--members") o.members = number(a, value());
                                            else if (a == "--rotate-val") o.rotate_val = true;
                                            else return false;
                                            return true;
                                          });
  if (args.help) return 0;
  if (args.lr) o.lr = positive_number("--lr", args.lr);
  const std::string& train_path = args.train;
  const std::string& val_path = args.val;
  const std::string& out_path = args.out;
  const auto train = read_graphs(train_path);
  const auto val = read_graphs(val_path);
  const gpucast::StepGnnTrainResult r = gpucast::train_step_gnn(train, val, o, out_path);
  std::printf("%s\n", nlohmann::json({{"train_graphs", train.size()},
                                      {"val_graphs", val.size()},
                                      {"epochs", r.epochs},
                                      {"best_epoch", r.best_epoch},
                                      {"train_mse_log", r.train_loss},
                                      {"val_mse_log", r.val_loss},
                                      {"applicability_radius", r.radius},
                                      {"seconds", std::round(r.train_seconds * 10) / 10},
                                      {"weights", out_path}})
                          .dump()
                          .c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc > 1 && std::string(argv[1]) == "step-gnn") return step_gnn_main(argc, argv);
    gpucast::TrainOptions o;
    const TrainArgs args = parse_train_args(argc, argv, 1, "gpucast-train", kUsage, o,
                                            [&](const std::string& a, const std::function<const char*()>& value) {
                                              if (a == "--d-model") o.model.d_model = std::max(2L, number(a, value()));
                                              else if (a == "--layers") o.model.encoder_layers = std::max(1L, number(a, value()));
                                              else return false;
                                              return true;
                                            });
    if (args.help) return 0;
    if (args.lr) o.lr = std::atof(args.lr);
    const std::string& train_path = args.train;
    const std::string& val_path = args.val;
    const std::string& out_path = args.out;
    const auto train = read_jobs(train_path);
    const auto val = read_jobs(val_path);
    const gpucast::TrainResult r = gpucast::train_job_model(train, val, o, out_path);
    std::printf("{\"train_jobs\": %zu, \"val_jobs\": %zu, \"epochs\": %ld, \"best_epoch\": %ld, "
                "\"val_loss\": %.6f, \"seconds\": %.1f, \"weights\": \"%s\"}\n",
                train.size(), val.size(), static_cast<long>(r.epochs), static_cast<long>(r.best_epoch),
                r.best_val_loss, r.train_seconds, out_path.c_str());
    return 0;
  } catch (const gpucast::UserError& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpucast-train: %s\n", e.what());
    return 1;
  }
}
