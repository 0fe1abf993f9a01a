# One-command entry points. `make demo` and `make test` work on a fresh Debian 12 machine.
BUILD ?= build
JOBS  ?= $(shell nproc)
CMAKE_FLAGS ?= -G Ninja -DCMAKE_BUILD_TYPE=Release $(if $(CI),-DGRADSYNC_WERROR=ON,)

.PHONY: all deps configure build test demo clean

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

# The lab: loss vs batch size, accumulation and DDP at 1, 2 and 4 ranks on Fashion-MNIST; report in lab-report/.
demo: build
	$(BUILD)/gradsync lab

clean:
	rm -rf $(BUILD)
