# One-command entry points. `make demo` and `make test` work on a fresh Debian 12 machine.
BUILD ?= build
JOBS  ?= $(shell nproc)
CMAKE_FLAGS ?= -G Ninja -DCMAKE_BUILD_TYPE=Release $(if $(CI),-DGRADSYNC_WERROR=ON,)

.PHONY: all deps configure build test sanitize demo clean

all: build

deps:
	bash scripts/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD) $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# Tests run two at a time: the machine has 2 cores and multi-rank tests pin one thread per rank.
test: build
	cd $(BUILD) && ctest --output-on-failure -j 2

# The file and fault tests under AddressSanitizer and UBSan, in a build of their own (build-sanitize/; about 30
# minutes on 2 cores: not part of `make test`). libtorch itself is not instrumented; its container annotations are
# off so that only gradsync's own accesses are checked.
SANITIZE_TESTS ?= StateDict|TorchFile|Dataset|Checkpoint|Resume|Faults|StoreServer
sanitize: deps
	cmake -S . -B build-sanitize -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGRADSYNC_SANITIZE=address,undefined \
	  -DGRADSYNC_BUILD_BENCH=OFF -DGRADSYNC_BUILD_EXAMPLES=OFF
	cmake --build build-sanitize -j $(JOBS) --target gradsync_tests gradsync_cli
	cd build-sanitize && ASAN_OPTIONS=detect_leaks=0:detect_container_overflow=0:abort_on_error=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ctest --output-on-failure -j 2 -R '$(SANITIZE_TESTS)'

# The lab: loss vs batch size, accumulation and DDP at 1, 2 and 4 ranks on Fashion-MNIST; report in lab-report/.
demo: build
	$(BUILD)/gradsync lab

clean:
	rm -rf $(BUILD)
