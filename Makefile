# Every developer command lives here; .ci/run calls `make test`.
.DEFAULT_GOAL := help
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# Tests start a local Ray cluster: keep it on 127.0.0.1 and its usage stats off.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: help
help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

.PHONY: setup
setup: $(BIN)/python engines ## venv + editable debug build with test and dev extras (torch included), engine wheels
	$(BIN)/pip install -q -e ".[test,dev]"

# The engines' released wheels, the oracles of tests/oracle: downloaded, never installed (tests/oracle/engines.py).
# The one list of verified versions is python/lorafast/compat/_versions.py (SUPPORTED); it runs without lorafast.
ENGINE_WHEELS := $(shell $(PY) python/lorafast/compat/_versions.py --wheels)
ENGINE_CACHE := .cache/engines
.PHONY: engines
engines: $(BIN)/python ## fetch the pinned SGLang and vLLM wheels for the oracle tests (pip download --no-deps)
	@mkdir -p $(ENGINE_CACHE)
	@for w in $(ENGINE_WHEELS); do \
	  n=$${w%%==*}; v=$${w##*==}; \
	  ls $(ENGINE_CACHE)/$$n-$$v-*.whl >/dev/null 2>&1 || $(BIN)/pip download -q --no-deps "$$w" -d $(ENGINE_CACHE) || exit 1; \
	done
	@# SGLang's server args are msgspec structs and its utils import pybase64: the oracle's child needs both
	@# (installed apart, never into the venv; tests/oracle/stubs.py puts the folder on the child's path).
	@test -d $(ENGINE_CACHE)/sglang-deps/msgspec || $(BIN)/pip install -q --target $(ENGINE_CACHE)/sglang-deps \
	  msgspec==0.23.0 pybase64==1.5.1

# What changed in an engine's LoRA code between two releases (the first step of adding a version, CONTRIBUTING.md).
OLD ?= vllm==0.33.0
NEW ?= vllm==0.34.0
.PHONY: engine-diff
engine-diff: $(BIN)/python ## list and diff the LoRA-path files of two engine wheels: make engine-diff OLD=vllm==0.33.0 NEW=vllm==0.34.0
	@mkdir -p $(ENGINE_CACHE)
	@for w in $(OLD) $(NEW); do \
	  n=$${w%%==*}; v=$${w##*==}; \
	  ls $(ENGINE_CACHE)/$$n-$$v-*.whl >/dev/null 2>&1 || $(BIN)/pip download -q --no-deps "$$w" -d $(ENGINE_CACHE) || exit 1; \
	done
	$(BIN)/python tests/oracle/engine_diff.py $(OLD) $(NEW) $(if $(NAMES_ONLY),--names-only)

.PHONY: build-release
build-release: $(BIN)/python ## optimised build of the extension into the venv (fat LTO: slow to compile)
	$(BIN)/pip install -q maturin
	$(BIN)/maturin develop --release -q

# The fixed reference of every speed claim (issue 32): a release build of BASELINE, installed apart, for the
# benchmarks' --before DIR. Built from `git archive` in /tmp (its own cargo target dir), never from this tree.
BASELINE ?= 255a378
BASELINE_DIR := .cache/baseline-$(BASELINE)
.PHONY: baseline
baseline: $(BIN)/python ## release build of the reference commit (BASELINE=255a378) into .cache/baseline-255a378, for the benchmarks' --before
	@if [ -d $(BASELINE_DIR)/lorafast ]; then echo "$(BASELINE_DIR) holds lorafast $(BASELINE) (rm -rf it to rebuild)"; else \
	  set -e; src=$$(mktemp -d /tmp/lorafast-src-$(BASELINE)-XXXXXX); \
	  git archive $(BASELINE) | tar -x -C $$src; \
	  echo "building lorafast $(BASELINE), release (fat LTO: minutes) ..."; \
	  flock /tmp/lorafast-build.lock env CARGO_TARGET_DIR=/tmp/target-$(BASELINE) \
	    $(BIN)/maturin build --release -q -i $(BIN)/python -m $$src/Cargo.toml --out $$src/dist; \
	  rm -rf $(BASELINE_DIR).part; \
	  $(BIN)/pip install -q --no-deps --target $(BASELINE_DIR).part $$src/dist/*.whl; \
	  mv $(BASELINE_DIR).part $(BASELINE_DIR); rm -rf $$src; echo "$(BASELINE_DIR) ready"; fi

# This tree's release build, installed apart (the venv keeps its debug build): the other side of --before.
BENCH_DIR := .cache/bench-head
.PHONY: bench-build
bench-build: $(BIN)/python ## release build of this tree into .cache/bench-head (PYTHONPATH=.cache/bench-head python benches/...)
	@set -e; rm -rf /tmp/lorafast-wheel-head; \
	flock /tmp/lorafast-build.lock env CARGO_TARGET_DIR=/tmp/target-rel \
	  $(BIN)/maturin build --release -q -i $(BIN)/python --out /tmp/lorafast-wheel-head; \
	rm -rf $(BENCH_DIR); $(BIN)/pip install -q --no-deps --target $(BENCH_DIR) /tmp/lorafast-wheel-head/*.whl; \
	echo "$(BENCH_DIR) holds this tree's release build"

.PHONY: demo
demo: $(BIN)/python ## the main job: a release build, then preflight of real launch commands on a fleet it writes (python -m lorafast.demo)
	@echo "building lorafast, release build (fat LTO: a few minutes the first time; cargo's progress below) ..."
	@bash -o pipefail -c '$(BIN)/pip install -v . 2>&1 | grep --line-buffered -E "^ *(Compiling|Finished|Built wheel)|Successfully installed"'
	@$(BIN)/lorafast --version
	rm -rf demo-fleet
	$(BIN)/python -m lorafast.demo demo-fleet

.PHONY: format
format: ## rustfmt + ruff format
	cargo fmt
	$(BIN)/ruff format python tests benches
	$(BIN)/ruff check --fix python tests benches

.PHONY: lint
lint: ## rustfmt check, clippy -D warnings over every feature set, ruff, mypy, stubtest of _core.pyi
	cargo fmt --check
	cargo clippy --no-default-features --all-targets -- -D warnings
	cargo clippy --no-default-features --features remote --all-targets -- -D warnings
	cargo clippy --features python,remote --all-targets -- -D warnings
	$(BIN)/ruff check python tests benches
	$(BIN)/mypy python/lorafast --ignore-missing-imports
	$(BIN)/python -m mypy.stubtest lorafast._core

.PHONY: test-rust
test-rust: ## cargo tests (pure core, no libpython): without features, then with the remote one
	cargo test --no-default-features
	cargo test --no-default-features --features remote

.PHONY: test-python
test-python: ## pytest against the installed build
	$(BIN)/python -m pytest -q -p no:cacheprovider

.PHONY: test-fast
test-fast: ## pytest without the oracle, Ray, remote, fuzz and slow families, hypothesis profile dev (a quick loop; make test is the gate)
	HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-dev} $(BIN)/python -m pytest -q -p no:cacheprovider -m "not oracle and not ray and not remote and not fuzz and not slow"

.PHONY: test
test: setup test-rust test-python ## set everything up, then run the whole suite
	@echo "make test leaves this build in $(VENV) (make build-release, or make demo, for a release one):"
	@$(BIN)/lorafast --version

# The Python fuzz harness (tests/fuzz/fuzz_python.py, atheris). `make test` runs a 30 s seeded pass of it.
FUZZ_SECONDS ?= 600
FUZZ_SEED ?= 1
.PHONY: fuzz-python
fuzz-python: $(BIN)/python ## long pass of the Python fuzz harness (FUZZ_SECONDS=600); crashers go to tests/fuzz-corpus/python
	$(BIN)/python tests/fuzz/fuzz_python.py --seeds .cache/fuzz-seeds
	@mkdir -p .cache/fuzz-python
	LORAFAST_FUZZ_OUT=tests/fuzz-corpus/python $(BIN)/python tests/fuzz/fuzz_python.py -seed=$(FUZZ_SEED) \
	  -max_total_time=$(FUZZ_SECONDS) -timeout=60 -artifact_prefix=tests/fuzz-corpus/python/ \
	  .cache/fuzz-python tests/fuzz-corpus/python .cache/fuzz-seeds

# The torch reader's differential harness (tests/fuzz/fuzz_torch.py, atheris, against torch.load(weights_only=True)).
# `make test` runs a 20 s seeded pass of it (tests/fuzz/test_fuzz_torch.py).
.PHONY: fuzz-torch
fuzz-torch: $(BIN)/python ## long pass of the torch reader's fuzz harness against torch.load (FUZZ_SECONDS=600); findings go to tests/fuzz-corpus/torch
	$(BIN)/python tests/fuzz/fuzz_torch.py --seeds .cache/fuzz-torch-seeds
	@mkdir -p .cache/fuzz-torch
	LORAFAST_FUZZ_OUT=tests/fuzz-corpus/torch $(BIN)/python tests/fuzz/fuzz_torch.py -seed=$(FUZZ_SEED) \
	  -max_total_time=$(FUZZ_SECONDS) -timeout=60 -artifact_prefix=tests/fuzz-corpus/torch/ \
	  .cache/fuzz-torch tests/fuzz-corpus/torch .cache/fuzz-torch-seeds

.PHONY: bench
bench: build-release ## benchmarks (ratios against baselines measured in the same run)
	$(BIN)/python benches/bench_header.py
	$(BIN)/python benches/bench_scan.py
	$(BIN)/python benches/bench_report.py
	$(BIN)/python benches/bench_preflight.py
	$(BIN)/python benches/bench_merge.py
	$(BIN)/python benches/bench_convert.py
	$(BIN)/python benches/bench_check.py

.PHONY: bench-fleet
bench-fleet: build-release ## remote (loopback S3) and Ray scan benchmarks
	$(BIN)/python benches/bench_remote.py
	$(BIN)/python benches/bench_ray.py

# Every fuzz harness (tests/rust/fuzz_*.rs) with many more inputs than `make test`'s short seeded
# pass, from a new seed each run; failing inputs are saved in tests/fuzz-corpus/.
FUZZ_CASES ?= 100000
.PHONY: fuzz
fuzz: ## long fuzz pass: FUZZ_CASES inputs per core harness (header, classify, names, config), new seed; then fuzz-python, fuzz-torch and fuzz-differential
	LORAFAST_FUZZ_CASES=$(FUZZ_CASES) LORAFAST_FUZZ_SEED=$${LORAFAST_FUZZ_SEED:-$$(date +%s)} \
	  cargo test --no-default-features --test fuzz_header --test fuzz_classify --test fuzz_names --test fuzz_config -- --nocapture
	$(MAKE) fuzz-python
	$(MAKE) fuzz-torch
	$(MAKE) fuzz-differential

# The hypothesis differential passes (tests/helpers/fuzzing.py): convert against PEFT and merge equality, Index.scan against a
# fresh scan under rewrites and concurrent scans. `make test` runs them short and seeded; this runs FUZZ_CASES inputs
# each from a new seed (LORAFAST_FUZZ_SEED to replay one).
.PHONY: fuzz-differential
fuzz-differential: $(BIN)/python ## long pass of the convert and Index differential fuzz (FUZZ_CASES inputs each)
	LORAFAST_FUZZ_CASES=$${LORAFAST_FUZZ_CASES:-500} LORAFAST_FUZZ_SEED=$${LORAFAST_FUZZ_SEED:-$$(date +%s)} \
	  $(BIN)/python -m pytest -q -p no:cacheprovider --timeout 0 tests/converting/test_convert_fuzz.py tests/scanning/test_index_fuzz.py tests/model/test_base_fuzz.py
