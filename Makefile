# The two commands a newcomer needs:
#   make test   install dependencies, build (Release) and run every test
#   make run    build, then start packd on 127.0.0.1:50051 (CPU)
BUILD_DIR ?= build
BUILD_TYPE ?= Release
CMAKE_FLAGS ?=
JOBS ?= $(shell nproc)

.PHONY: all deps configure build test run bench clean format

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

clean:
	rm -rf $(BUILD_DIR)

format:
	git ls-files '*.h' '*.cc' '*.cu' '*.cuh' | xargs clang-format -i
