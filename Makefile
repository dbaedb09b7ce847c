# gpucast: `make demo` and `make test` do all of the setup on a fresh machine.
#   make venv      .venv with the pinned Python packages (requirements.txt)
#   make deps      Debian packages: GoogleTest, fmt (apt-get; skipped when present)
#   make build     configure and build with CMake (build/)
#   make demo      trace the GPT-style example on the CPU and print its summary
#   make test      GoogleTest (ctest) and pytest
#   make sanitize  the C++ tests and a pytest subset under AddressSanitizer and UBSan (build-sanitize/; tests/sanitize.sh)
#   make bench     overhead benchmark
#   make dataset   regenerate bench/dataset/jobs.jsonl.gz (the job-level memory dataset; about 45 min on 2 cores)
#   make gpu-dataset  extend bench/dataset/gpu_jobs.jsonl.gz (GPU jobs labelled by meta-probe forecasts; resumable,
#                  GPU_GROUPS groups of 64 rows, default 400: about 3 hours on 2 cores)
#   make weights   train the job-level model and ship its weights (bench/learned_memory.py --ship)
#   make fuzz      fuzz every parser: FUZZ_SECONDS of mutations per target (default 120), finds saved in build/fuzz/
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BUILD := build
APT_PACKAGES := libgtest-dev libgmock-dev libfmt-dev cmake ninja-build g++
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: all venv deps configure build demo test test-cpp test-python sanitize bench dataset gpu-dataset weights fuzz clean

all: build

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

venv: $(VENV)/.installed

$(BUILD)/.deps:
	@if dpkg -s $(APT_PACKAGES) >/dev/null 2>&1; then echo "deps: Debian packages present"; \
	else $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $(APT_PACKAGES); fi
	@mkdir -p $(BUILD) && touch $@

deps: $(BUILD)/.deps

$(BUILD)/build.ninja: $(VENV)/.installed $(BUILD)/.deps CMakeLists.txt
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DCMAKE_PREFIX_PATH="$$($(PY) -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
	  -DGPUCAST_WERROR=$${GPUCAST_WERROR:-OFF}

configure: $(BUILD)/build.ninja

build: configure
	cmake --build $(BUILD) -j2

demo: build
	PYTHONPATH=python $(PY) examples/gpt.py

test-cpp: build
	ctest --test-dir $(BUILD) --output-on-failure

test-python: build
	PYTHONPATH=python:. $(PY) -m pytest tests/python -q

test: test-cpp test-python

sanitize: venv deps
	tests/sanitize.sh

bench: build
	PYTHONPATH=python:. $(PY) bench/overhead.py

# Two processes (this machine has 2 cores); each part is resumable, then the parts are merged and compressed.
dataset: build
	mkdir -p $(BUILD)/dataset
	PYTHONPATH=python:. $(PY) bench/dataset/generate.py --first 0 --jobs 1560 --out $(BUILD)/dataset/part0.jsonl & \
	PYTHONPATH=python:. $(PY) bench/dataset/generate.py --first 1560 --jobs 1560 --out $(BUILD)/dataset/part1.jsonl; wait
	cat $(BUILD)/dataset/part0.jsonl $(BUILD)/dataset/part1.jsonl > $(BUILD)/dataset/jobs.jsonl
	PYTHONPATH=python:. $(PY) bench/dataset/generate.py --jobs 0 --out $(BUILD)/dataset/jobs.jsonl --gzip
	cp $(BUILD)/dataset/jobs.jsonl.gz bench/dataset/jobs.jsonl.gz

# Two processes over halves of the groups; each part resumes where it stopped (the committed groups are kept), then
# the parts are merged in group order and compressed.
GPU_GROUPS ?= 400
gpu-dataset: build
	mkdir -p $(BUILD)/dataset
	test -f $(BUILD)/dataset/gpu_jobs.jsonl || zcat bench/dataset/gpu_jobs.jsonl.gz > $(BUILD)/dataset/gpu_jobs.jsonl 2>/dev/null || true
	cp $(BUILD)/dataset/gpu_jobs.jsonl $(BUILD)/dataset/gpu_part0.jsonl; cp $(BUILD)/dataset/gpu_jobs.jsonl $(BUILD)/dataset/gpu_part1.jsonl
	PYTHONPATH=python:. $(PY) bench/dataset/gpu_jobs.py --first 0 --groups $$(($(GPU_GROUPS) / 2)) --out $(BUILD)/dataset/gpu_part0.jsonl & \
	PYTHONPATH=python:. $(PY) bench/dataset/gpu_jobs.py --first $$(($(GPU_GROUPS) / 2)) --groups $$(($(GPU_GROUPS) / 2)) --out $(BUILD)/dataset/gpu_part1.jsonl; wait
	cat $(BUILD)/dataset/gpu_part0.jsonl $(BUILD)/dataset/gpu_part1.jsonl | sort -u > $(BUILD)/dataset/gpu_jobs.jsonl
	PYTHONPATH=python:. $(PY) bench/dataset/gpu_jobs.py --groups 0 --out $(BUILD)/dataset/gpu_jobs.jsonl --gzip
	cp $(BUILD)/dataset/gpu_jobs.jsonl.gz bench/dataset/gpu_jobs.jsonl.gz

weights: build
	PYTHONPATH=python:. $(PY) bench/learned_memory.py --ship --lr 0.001

# The parsers' fuzz targets (tests/fuzz/run.py), longer than the test's bounded run: the corpus, the known faults'
# inputs, the saved crashes, then mutations for FUZZ_SECONDS per target; a summary in build/fuzz/summary.json.
fuzz: build
	PYTHONPATH=python:. $(PY) tests/fuzz/run.py --seconds $${FUZZ_SECONDS:-120} --seed $${FUZZ_SEED:-0} \
	  --known --crashes --out $(BUILD)/fuzz --json $(BUILD)/fuzz/summary.json

clean:
	rm -rf $(BUILD) build-sanitize
