#!/usr/bin/env bash
# The GPU checks, as one script for the lent GPU machine (no network, no apt: builds from the tree, tests off).
# Writes results under bench/results/gpu/ and allocator histories under tests/data/. Budget: under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=bench/results/gpu
mkdir -p "$out"
PY=${PYTHON:-python3}
# On the lent machine only $OUT comes back: everything written goes there as one archive, also on failure.
pack() {
  if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/gpu_results.tgz" --exclude="$out/probes" "$out" $(ls tests/data/alloc_history_*.json 2>/dev/null)
    [ -d "$out/probes" ] && tar czf "$OUT/gpu_probes.tgz" "$out/probes"
  fi
}
trap pack EXIT
start=$(date +%s)
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
} > "$out/machine.txt" 2>&1
timeout 300 cmake -S . -B build-gpu -G Ninja -DGPUCAST_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$($PY -c 'import torch; print(torch.utils.cmake_prefix_path)')" > "$out/build.txt" 2>&1 \
  && timeout 300 cmake --build build-gpu -j16 >> "$out/build.txt" 2>&1 || { echo "build failed"; tail -30 "$out/build.txt"; exit 1; }
echo "built in $(( $(date +%s) - start )) s"
export GPUCAST_LIBRARY=$PWD/build-gpu/lib/libgpucast.so PYTHONPATH=$PWD/python:$PWD PYTHONUNBUFFERED=1
target=$($PY - <<'PY'
import torch
n = torch.cuda.get_device_name(0).upper()
print("H200-141GB" if "H200" in n else "H100-80GB" if "H100" in n else "A100-80GB")
PY
)
phase() { echo "$1 rc=$2 at $(( $(date +%s) - start )) s" | tee -a "$out/phases.txt"; }
: > "$out/phases.txt"
# Real allocator histories (tests/data/, replayed in CI): GPUCAST_GPU_HISTORIES=0 leaves the committed ones.
if [ "${GPUCAST_GPU_HISTORIES:-1}" != 0 ]; then
  timeout 90 $PY bench/gpu/record_histories.py > "$out/histories.txt" 2>&1; phase histories $?
fi
# The probes' traces, for replaying the forecast elsewhere (not committed: a separate archive).
timeout 150 $PY bench/memory_accuracy.py --target "$target" --cases mlp,cnn,gpt,resnet18 --save-probes "$out/probes" \
  > "$out/memory_accuracy.txt" 2>&1
phase memory_accuracy $?
# CPU probes for the GPU: the rules for what CUDA allocates differently (cuDNN workspaces: reported headroom).
if [ "${GPUCAST_GPU_CPU_PROBES:-1}" != 0 ]; then
  timeout 60 $PY bench/memory_accuracy.py --target "$target" --cpu-probes --cases cnn,resnet18 \
    > "$out/memory_from_cpu_probes.txt" 2>&1
  phase memory_from_cpu_probes $?
fi
# The default cases' steps are bound by the host's launches on an H200; resnet18@512 about even (its kernels took
# 59 % of the step in the fourth run); gpt@1024 and resnet18@2048 by the device.
timeout 230 $PY bench/gpu/step_time_check.py --target "$target" --save-timings "$out/timings" \
  --cases "${GPUCAST_GPU_STEP_CASES:-gpt,cnn,resnet18,resnet18@512,gpt@1024,resnet18@2048}" > "$out/step_time_check.txt" 2>&1
phase step_time_check $?
# FSDP2 on one rank (NCCL, world size 1): the FSDP2 memory rule against a real fully_shard run.
timeout 90 $PY bench/gpu/fsdp_check.py --target "$target" > "$out/fsdp_check.txt" 2>&1
phase fsdp_check $?
echo "all in $(( $(date +%s) - start )) s"
tail -n 12 "$out"/*.txt
