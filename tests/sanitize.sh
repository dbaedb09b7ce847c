#!/usr/bin/env bash
# `make sanitize`: gpucast's C++ (the GoogleTest binaries and the plugin) built with AddressSanitizer and
# UndefinedBehaviorSanitizer in build-sanitize/, the C++ tests run under them, then the pytest files that drive the
# parsers, the trace and the forecasts through the plugin (SANITIZE_PYTEST, below), in a Python with the ASan runtime
# preloaded. Any finding fails the run (-fno-sanitize-recover=all).
#
# Settings, each with its reason:
# - libstdc++ preloaded after the ASan runtime: python does not link it, and ASan's __cxa_throw interceptor finds
#   no real __cxa_throw when it initialises before libstdc++ is loaded (every C++ exception would then abort).
# - detect_leaks=0: CPython and torch keep objects alive until exit by design (interned strings, the dispatcher's
#   registrations, CUDA/OpenMP pools); a leak report at exit would be theirs, not gpucast's. gpucast's own leaks are
#   checked where they can be: the C++ test binaries run with leak detection on.
# - The pytest subset, not every file: the full suite's subprocess-heavy files (real training runs, packaging, the
#   benches) take over an hour under ASan on 2 cores and add no parser or trace path the subset lacks.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${SANITIZE_BUILD:-build-sanitize}
PY=${PY:-.venv/bin/python}
# Auto mode's observer runs inside the training job's callbacks: a few of its runs (each a fresh process, which
# inherits the preloaded runtime) are in the subset too.
AUTO="tests/python/test_auto_plugin.py"
# Meta probes: the trace's fold of Python meta kernels, the kernels registered while the probes run, one forecast.
META="tests/python/test_meta_probes.py"
META_TESTS="$META::test_a_python_meta_kernel_is_traced_as_one_kernel $META::test_meta_attention_runs_the_kernel_the_cpu_picks $META::test_meta_resize_allocates_through_the_meta_allocator $META::test_meta_ops_run_the_composite_the_cpu_runs $META::test_meta_probes_forecast_what_cpu_probes_forecast_to_the_byte[mlp]"
SANITIZE_PYTEST=${SANITIZE_PYTEST:-"$META_TESTS tests/python/test_error_codes.py tests/python/test_bad_input.py tests/python/test_faults.py tests/python/test_fuzz.py tests/python/test_golden.py tests/python/test_job.py tests/python/test_step_gnn.py $AUTO::test_load_library_warns_once_before_iteration_two $AUTO::test_load_library_raise_stops_iteration_two_at_its_first_allocation $AUTO::test_an_interrupted_first_iteration_is_not_forecast_from $AUTO::test_two_models_trained_at_once_are_refused_with_a_note $AUTO::test_a_malformed_configuration_never_fails_the_load $AUTO::test_categories_from_autograd_equal_the_python_hooks[mlp]"}

if [ ! -f "$BUILD/build.ninja" ]; then
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGPUCAST_SANITIZE=address,undefined \
    -DCMAKE_PREFIX_PATH="$($PY -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
    -DGPUCAST_WERROR="${GPUCAST_WERROR:-OFF}"
fi
cmake --build "$BUILD" -j2

export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 ctest --test-dir "$BUILD" --output-on-failure

files=()
for f in $SANITIZE_PYTEST; do [ -f "${f%%::*}" ] && files+=("$f"); done
ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
LD_PRELOAD="$(${CXX:-g++} -print-file-name=libasan.so) $(${CXX:-g++} -print-file-name=libstdc++.so)" \
GPUCAST_LIBRARY="$PWD/$BUILD/lib/libgpucast.so" \
PYTHONPATH=python:. "$PY" -m pytest -q -p no:cacheprovider "${files[@]}"
