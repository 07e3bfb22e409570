# Entry points. `make run`: install what is missing, build, sample from the bundled model.
# `make test`: install, build, run the whole test suite (plus the gate tests under TSan).
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: deps build run test test-tsan bench clean format

deps:
	@scripts/install-deps.sh

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)
	cmake --build $(BUILD) -j $(JOBS)

run: build
	$(BUILD)/ptllm sample --prompt "ROMEO:" --tokens 500

test: build
	scripts/install-deps.sh --tests
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)
	$(MAKE) test-tsan

# The gate runs on a background thread: its tests also run under ThreadSanitizer.
test-tsan: deps
	cmake -S . -B $(BUILD)-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPTLLM_SANITIZE=thread -DPTLLM_CUDA=OFF
	cmake --build $(BUILD)-tsan -j $(JOBS) --target test_gate test_thread_pool test_serve
	cd $(BUILD)-tsan && TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$(CURDIR)/tests/tsan.supp" ctest --output-on-failure -j $(JOBS) -R "^(Gate|PathSet|PathSelectionParse|ThreadPool|Serve)\."

bench: build
	scripts/install-deps.sh --peers
	bench/run_bench.sh

format:
	clang-format -i $$(git ls-files '*.cpp' '*.h' '*.cu' '*.cuh')

clean:
	rm -rf $(BUILD) $(BUILD)-tsan
