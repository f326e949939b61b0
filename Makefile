# The two commands a newcomer needs:
#   make test   install dependencies, build (Release) and run every test
#   make run    build, then start packd on 127.0.0.1:50051 (CPU)
BUILD_DIR ?= build
BUILD_TYPE ?= Release
CMAKE_FLAGS ?=
JOBS ?= $(shell nproc)

FUZZ_DIR ?= build-fuzz
FUZZ_SECONDS ?= 60
FUZZ_TARGETS = fuzz_request fuzz_regions fuzz_plan

TSAN_DIR ?= build-tsan
TSAN_TESTS = server_regions_test memory_budget_test metrics_test regions_test service_test soak_test \
  shared_client_test client_fake_gpu_test stream_step_test client_step_test

.PHONY: all deps configure build test run wheel bench bench-step bench-grpo bench-train bench-stream bench-trl plots image check-image fuzz tsan clean format

all: build

deps:
	deploy/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_FLAGS)

# BUILD_TARGETS narrows the build to what a narrowed test run needs (default: everything).
BUILD_TARGETS ?=
build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) $(if $(BUILD_TARGETS),--target $(BUILD_TARGETS))

# CTEST_ARGS narrows the run (e.g. CTEST_ARGS="-R gpu_"). ctest runs JOBS tests at once, so each
# test's torch computes on one thread (TEST_THREADS): torch's OpenMP workers spin while they wait,
# and two tests of two threads each on two cores ran the model tests six times slower.
CTEST_ARGS ?=
TEST_THREADS ?= 1
test: build
	cd $(BUILD_DIR) && OMP_NUM_THREADS=$(TEST_THREADS) ctest --output-on-failure -j $(JOBS) $(CTEST_ARGS)

run: build
	$(BUILD_DIR)/bin/packd --listen=127.0.0.1:50051 --device=cpu

# The Python client's wheel, $(BUILD_DIR)/dist/packd-VERSION-py3-none-any.whl (python/make_wheel.sh).
wheel: configure
	cmake --build $(BUILD_DIR) --target packd_wheel

bench: build
	$(BUILD_DIR)/bin/bench_pack

# The charts in docs/performance.md (benchmarks/plot.py): the benchmarks run in full, then drawn.
plots: build
	benchmarks/plots.sh $(BUILD_DIR)/bin docs/plots

# A training step's preparation three ways (benchmarks/bench_step.py): PackMicroBatches, a plan
# and a Pack per micro-batch, and verl's own step on PyPI's torch 2 (the PyPI stack's venv);
# through handles and inline. BENCH_STACK=debian runs it on Debian's torch 1.13 instead.
BENCH_STACK ?= pypi
bench-step: build
	cd $(BUILD_DIR) && ctest -R '^python_install$(if $(filter pypi,$(BENCH_STACK)),_pypi)$$' > /dev/null && \
	  venv$(if $(filter pypi,$(BENCH_STACK)),-pypi)/bin/python $(CURDIR)/benchmarks/bench_step.py --packd bin/packd

# A GRPO batch's forward and backward with its prompts shared and not (benchmarks/bench_grpo.py).
bench-grpo: build
	cd $(BUILD_DIR) && ctest -R python_install > /dev/null && \
	  venv/bin/python $(CURDIR)/benchmarks/bench_grpo.py --packd bin/packd

# A transformers model's training step on a GRPO rollout, padded, flattened by transformers and
# packed by packd (benchmarks/bench_train.py), on PyPI's stack (transformers): Qwen 3, then the
# hybrid Qwen 3.5 (gated delta nets).
bench-train: build
	cd $(BUILD_DIR) && ctest -R '^python_install_pypi$$' > /dev/null && \
	  venv-pypi/bin/python $(CURDIR)/benchmarks/bench_train.py --packd bin/packd && \
	  venv-pypi/bin/python $(CURDIR)/benchmarks/bench_train.py --packd bin/packd --family qwen3_5

# TRL's GRPOTrainer against packd.trl's on the same frozen generation batches
# (benchmarks/bench_trl.py): tokens forwarded and time per optimizer step, on PyPI's stack (TRL).
bench-trl: build
	cd $(BUILD_DIR) && ctest -R '^python_install_pypi$$' > /dev/null && \
	  venv-pypi/bin/python $(CURDIR)/benchmarks/bench_trl.py --packd bin/packd

# The streaming step against waiting for the whole batch (benchmarks/bench_stream.py): rollouts
# finishing over time, bench-train's model trained both ways, on PyPI's stack (transformers).
bench-stream: build
	cd $(BUILD_DIR) && ctest -R '^python_install_pypi$$' > /dev/null && \
	  venv-pypi/bin/python $(CURDIR)/benchmarks/bench_stream.py --packd bin/packd

# The server image (Dockerfile; a running Docker daemon), and its end-to-end check.
IMAGE ?= packd:latest
image:
	deploy/build-image.sh $(IMAGE)

check-image:
	deploy/check-image.sh $(IMAGE)

# The libFuzzer targets (clang, ASan + UBSan), each run FUZZ_SECONDS from its seed corpus
# (tests/fuzz/corpus/<target>; new inputs go to $(FUZZ_DIR)/corpus). Fails on any crash, leak or
# sanitizer report; the input that caused it is left in $(FUZZ_DIR).
fuzz: deps
	CC=clang CXX=clang++ cmake -S . -B $(FUZZ_DIR) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DPACKD_FUZZ=ON -DPACKD_WITH_TORCH=OFF -DPACKD_WITH_CUDA=OFF -DPACKD_BUILD_TESTS=OFF \
	  -DPACKD_BUILD_BENCHMARKS=OFF
	cmake --build $(FUZZ_DIR) -j $(JOBS) --target $(FUZZ_TARGETS)
	set -e; for t in $(FUZZ_TARGETS); do \
	  mkdir -p $(FUZZ_DIR)/corpus/$$t; \
	  echo "== $$t ($(FUZZ_SECONDS) s)"; \
	  (cd $(FUZZ_DIR) && bin/$$t -max_total_time=$(FUZZ_SECONDS) -timeout=10 -rss_limit_mb=2048 \
	    -print_final_stats=1 corpus/$$t $(CURDIR)/tests/fuzz/corpus/$$t); \
	done

# ThreadSanitizer: the service, regions and load tests (and the packd they start) built with
# -fsanitize=thread, run against abseil's synchronization library built with TSan too
# (tests/tsan/build_absl_sync.sh), with the suppressions in tests/tsan/tsan.supp. Fails on any
# report, in a test or in a server it starts.
tsan: deps
	tests/tsan/build_absl_sync.sh $(TSAN_DIR)/absl-sync
	cmake -S . -B $(TSAN_DIR) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPACKD_TSAN=ON \
	  -DPACKD_WITH_CUDA=OFF -DPACKD_BUILD_BENCHMARKS=OFF
	cmake --build $(TSAN_DIR) -j $(JOBS) --target packd packd_testing $(TSAN_TESTS)
	cd $(TSAN_DIR) && LD_LIBRARY_PATH=$(CURDIR)/$(TSAN_DIR)/absl-sync \
	  TSAN_OPTIONS="halt_on_error=1 history_size=7 ignore_noninstrumented_modules=1 suppressions=$(CURDIR)/tests/tsan/tsan.supp" \
	  ctest --output-on-failure -j $(JOBS) -R '^($(shell echo $(TSAN_TESTS) | tr ' ' '|'))$$'

clean:
	rm -rf $(BUILD_DIR)

format:
	git ls-files '*.h' '*.cc' '*.cu' '*.cuh' | xargs clang-format -i
