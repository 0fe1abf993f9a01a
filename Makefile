# One-command entry points. `make demo` and `make test` work on a fresh Debian 12 machine.
#
# TORCH picks the libtorch line (both are installed by scripts/install-deps.sh):
#   pip    (default) torch==$(TORCH_VERSION) from the Python package index, in a virtual environment at $(VENV): its
#          C++ SDK builds gradsync and its Python is the tests' reference; build directory build/
#   debian Debian 12's libtorch-dev 1.13.1 and python3-torch; build directory build-debian/
# TESTS=REGEX runs only the tests whose names match (ctest -R).
TORCH ?= pip
TORCH_VERSION ?= 2.11.0
VENV ?= $(HOME)/.cache/gradsync/venv-torch-$(TORCH_VERSION)
ifeq ($(TORCH),debian)
BUILD ?= build-debian
TORCH_FLAGS = -DGRADSYNC_PYTHON=/usr/bin/python3
else ifeq ($(TORCH),pip)
BUILD ?= build
# The wheel's own CMake prefix, as a user would pass it (torch.utils.cmake_prefix_path), asked at configure time.
TORCH_FLAGS = -DGRADSYNC_PYTHON=$(VENV)/bin/python \
  -DCMAKE_PREFIX_PATH="$$($(VENV)/bin/python -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
else
$(error TORCH=$(TORCH): expected pip (torch $(TORCH_VERSION) from the package index) or debian (libtorch 1.13.1))
endif
JOBS  ?= $(shell nproc)
CMAKE_FLAGS ?= -G Ninja -DCMAKE_BUILD_TYPE=Release $(if $(CI),-DGRADSYNC_WERROR=ON,)
# CMAKE_EXTRA adds -D options to the configure step (.ci/run builds the Debian line without examples and benchmarks).
CMAKE_EXTRA ?=
# ccache, where installed: the compiles are slow (25-40 s per torch TU). BASEDIR lets another clone's build hit the
# same cache; the sloppiness lets it cache the precompiled header and the TUs that use it.
export CCACHE_BASEDIR ?= $(CURDIR)
export CCACHE_SLOPPINESS ?= pch_defines,time_macros,include_file_mtime,include_file_ctime
export CCACHE_MAXSIZE ?= 20G
LAUNCHER = $(if $(shell command -v ccache),-DCMAKE_CXX_COMPILER_LAUNCHER=ccache,)

.PHONY: all deps configure build test sanitize demo clean

all: build

deps:
	GRADSYNC_TORCH_VERSION=$(TORCH_VERSION) GRADSYNC_VENV=$(VENV) bash scripts/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD) $(CMAKE_FLAGS) $(LAUNCHER) $(TORCH_FLAGS) $(CMAKE_EXTRA)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# Tests run two at a time: the machine has 2 cores and multi-rank tests pin one thread per rank.
test: build
	cd $(BUILD) && ctest --output-on-failure -j 2 $(if $(TESTS),-R '$(TESTS)',)

# The file and fault tests under AddressSanitizer and UBSan, in a build of their own (build-sanitize/; about 30
# minutes on 2 cores: not part of `make test`). libtorch itself is not instrumented; its container annotations are
# off so that only gradsync's own accesses are checked.
SANITIZE_TESTS ?= StateDict|TorchFile|Dataset|Checkpoint|Resume|Faults|StoreServer
SANITIZE_BUILD = build-sanitize$(if $(filter debian,$(TORCH)),-debian,)
sanitize: deps
	cmake -S . -B $(SANITIZE_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DGRADSYNC_SANITIZE=address,undefined $(LAUNCHER) $(TORCH_FLAGS) \
	  -DGRADSYNC_BUILD_BENCH=OFF -DGRADSYNC_BUILD_EXAMPLES=OFF
	cmake --build $(SANITIZE_BUILD) -j $(JOBS) --target gradsync_tests gradsync_cli
	cd $(SANITIZE_BUILD) && ASAN_OPTIONS=detect_leaks=0:detect_container_overflow=0:abort_on_error=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ctest --output-on-failure -j 2 -R '$(SANITIZE_TESTS)'

# The lab: loss vs batch size, accumulation and DDP at 1, 2 and 4 ranks on Fashion-MNIST; report in lab-report/.
demo: build
	$(BUILD)/gradsync lab

clean:
	rm -rf $(BUILD)
