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

.PHONY: all deps configure build test run bench fuzz clean format

all: build

deps:
	deploy/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS)

run: build
	$(BUILD_DIR)/bin/packd --listen=127.0.0.1:50051 --device=cpu

bench: build
	$(BUILD_DIR)/bin/bench_pack

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

clean:
	rm -rf $(BUILD_DIR)

format:
	git ls-files '*.h' '*.cc' '*.cu' '*.cuh' | xargs clang-format -i
