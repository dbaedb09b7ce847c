// A LibTorch training loop with gpucast's auto mode: a small MLP classifier trained with AdamW on random data.
//
//   GPUCAST_CONF="enabled:True,target:H100-80GB,capacity_mb:700" ./build/bin/gpucast-example-train
//
// gpucast forecasts the run from the first iteration and, before the second allocates, warns (c10's warning, on
// stderr) or, with on_risk:raise, stops the job: the second iteration's first allocation throws a c10::Error whose
// message starts "gpucast: out-of-memory risk".
#include <torch/torch.h>

#include <gpucast/gpucast.h>

#include <cstdlib>
#include <iostream>

int main(int argc, char** argv) {
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 3;
  std::cerr << "gpucast loaded from " << gpucast::library_path() << std::endl;
  torch::manual_seed(0);
  torch::set_num_threads(1);
  torch::nn::Sequential model(torch::nn::Linear(784, 256), torch::nn::ReLU(), torch::nn::Linear(256, 256),
                              torch::nn::ReLU(), torch::nn::Linear(256, 10));
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  const torch::Tensor inputs = torch::randn({64, 784});
  const torch::Tensor targets = torch::randint(0, 10, {64});
  for (int i = 1; i <= iterations; ++i) {
    std::cerr << "iteration " << i << " start" << std::endl;
    try {
      gpucast::zero_grad(optimizer);
      torch::Tensor loss = torch::nn::functional::cross_entropy(model->forward(inputs), targets);
      loss.backward();
      gpucast::step(optimizer);
    } catch (const c10::Error& e) {
      std::cerr << "raised in iteration " << i << ": " << e.msg() << std::endl;
      return 3;
    }
  }
  std::cerr << "done" << std::endl;
  return 0;
}
