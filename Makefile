# Strata - the commands a user runs. README.md's quick start is `make run` and `make test`.
#   make deps       install missing Debian packages (apt-get) and tests/ref (npm ci); idempotent,
#                   quiet when all present
#   make build      configure and build into build/
#   make test       deps + build + every test that needs no GPU, then all of them again under ASan+UBSan
#   make test-slow  the long suites (ctest label `slow`)
#   make test-builds  the other builds a user may pick (Release; clang), each with its tests
#   make tsan       ThreadSanitizer build (clang) and its tests (suppressions: tests/tsan.supp)
#   make bench      benchmarks, then the engine beside llama.cpp (bench/bench_vs_llama.mjs)
#                   (BENCH_ARGS=--quick for a short run); figures: docs/BENCHMARKS.md
#   make run        deps + build + strata-server with the demo model (qwen35, the real Qwen3
#                   vocabulary and chat template, seeded weights); MODEL=path/to/model.gguf
#                   serves a downloaded GGUF instead
#   make fuzz       libFuzzer targets (clang) into build-fuzz/; FUZZ_SECONDS=60 make fuzz-run
#   make install    build, then install the programs, libstrata, the headers and strata.pc under
#                   PREFIX (default /usr/local), inside DESTDIR when set (docs/PACKAGING.md);
#                   COMPONENT=runtime|dev installs one part only
# The test targets build with warnings as errors (STRATA_WERROR=ON, kept in the build's cache);
# a plain `make build` or cmake leaves that to the CMake option, OFF by default.
MAKEFLAGS  += --no-print-directory
BUILD      ?= build
ASAN_BUILD ?= build-asan
FUZZ_BUILD ?= build-fuzz
TSAN_BUILD ?= build-tsan
REL_BUILD  ?= build-release
CLANG_BUILD ?= build-clang
FUZZ_SECONDS ?= 60
WERROR     ?=
JOBS       ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_ARGS ?=
CTEST_ARGS ?=
MODEL      ?=
PREFIX     ?= /usr/local
DESTDIR    ?=
COMPONENT  ?=

DEB_PKGS := pkg-config cmake make gcc liblmdb-dev lmdb-utils libzstd-dev libssl-dev libevent-dev \
            libjansson-dev libxxhash-dev libcmocka-dev libicu-dev git curl clang-14 libclang-rt-14-dev llvm-14 \
            chromium redis-server libhiredis-dev
# The independent implementations the tests compare against (llama.cpp v0.4.0, prebuilt), pinned
# by tests/ref/package-lock.json and installed with `npm ci` into tests/ref/node_modules (Node.js
# >= 20 and npm must be present); a stamp of the lock keeps a second `make deps` quiet.
REF_DIR   := tests/ref
REF_STAMP := $(REF_DIR)/node_modules/.strata-lock.sha256

.PHONY: all deps build asan-build test test-slow test-builds test-gpu tsan bench run fuzz fuzz-run install clean

# -DSTRATA_WERROR=... only where a target asks for it (a plain build keeps what its cache holds)
werror = $(if $(WERROR),-DSTRATA_WERROR=$(WERROR))
test test-slow test-builds test-gpu tsan fuzz: WERROR = ON
SAN_ENV := ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

all: build

deps:
	@missing=""; \
	for p in $(DEB_PKGS); do \
	  dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "make deps: installing$$missing"; \
	  if [ "$$(id -u)" -ne 0 ]; then sudo=sudo; else sudo=; fi; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  $$sudo apt-get install -y -q $$missing >/dev/null 2>&1 || \
	  { $$sudo apt-get update -q >/dev/null && $$sudo apt-get install -y -q $$missing >/dev/null; } || \
	  { echo "make deps: apt-get could not install:$$missing" >&2; exit 1; }; \
	fi
	@want="$$(cat $(REF_DIR)/package.json $(REF_DIR)/package-lock.json $(REF_DIR)/.npmrc | sha256sum)"; \
	if [ "$$(cat $(REF_STAMP) 2>/dev/null)" != "$$want" ]; then \
	  command -v npm >/dev/null 2>&1 || \
	    { echo "make deps: npm (Node.js >= 20) is needed to install $(REF_DIR)" >&2; exit 1; }; \
	  echo "make deps: npm ci in $(REF_DIR) (llama.cpp v0.4.0 prebuilt, for the comparison tests)"; \
	  log=$$(mktemp); \
	  (cd $(REF_DIR) && npm ci --no-progress) >$$log 2>&1 || \
	    { cat $$log >&2; rm -f $$log; echo "make deps: npm ci in $(REF_DIR) failed" >&2; exit 1; }; \
	  rm -f $$log; echo "$$want" > $(REF_STAMP); \
	fi

build: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(werror) $(CMAKE_ARGS) >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

asan-build: deps
	@cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DSTRATA_SANITIZE=ON -DSTRATA_CUDA=OFF $(werror) $(CMAKE_ARGS) >/dev/null
	@cmake --build $(ASAN_BUILD) -j $(JOBS)

test: build asan-build
	ctest --test-dir $(BUILD) -LE 'slow|gpu' --output-on-failure -j $(JOBS) $(CTEST_ARGS)
	$(SAN_ENV) ctest --test-dir $(ASAN_BUILD) -LE 'slow|gpu' --output-on-failure -j $(JOBS) $(CTEST_ARGS)

# Release (gcc, with CUDA where nvcc is found) and clang 14 (RelWithDebInfo; its CUDA parts, if
# any, still go through nvcc, whose host compiler is gcc): each builds everything and runs the
# tests that need no GPU, so that no configuration a user may pick breaks unseen.
test-builds: deps
	@cmake -S . -B $(REL_BUILD) -DCMAKE_BUILD_TYPE=Release $(werror) $(CMAKE_ARGS) >/dev/null
	@cmake --build $(REL_BUILD) -j $(JOBS)
	ctest --test-dir $(REL_BUILD) -LE 'slow|gpu' --output-on-failure -j $(JOBS) $(CTEST_ARGS)
	@CC=clang-14 cmake -S . -B $(CLANG_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(werror) $(CMAKE_ARGS) >/dev/null
	@cmake --build $(CLANG_BUILD) -j $(JOBS)
	ctest --test-dir $(CLANG_BUILD) -LE 'slow|gpu' --output-on-failure -j $(JOBS) $(CTEST_ARGS)

# ThreadSanitizer: clang 14's, whose reports the suppression file can match by the memory map
# (gcc 12's cannot: LMDB's false positives on data.mdb would remain).
tsan: deps
	@CC=clang-14 cmake -S . -B $(TSAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DSTRATA_TSAN=ON -DSTRATA_CUDA=OFF $(werror) $(CMAKE_ARGS) >/dev/null
	@cmake --build $(TSAN_BUILD) -j $(JOBS)
	TSAN_OPTIONS="suppressions=$(CURDIR)/tests/tsan.supp halt_on_error=1 external_symbolizer_path=/usr/lib/llvm-14/bin/llvm-symbolizer" \
	  ctest --test-dir $(TSAN_BUILD) -LE 'slow|gpu' --output-on-failure -j $(JOBS) $(CTEST_ARGS)

test-slow: build
	ctest --test-dir $(BUILD) -L slow --output-on-failure $(CTEST_ARGS)

test-gpu: deps
	@cmake -S . -B build-gpu -DSTRATA_CUDA=ON $(CMAKE_ARGS) >/dev/null
	@cmake --build build-gpu -j $(JOBS)
	ctest --test-dir build-gpu -L gpu --output-on-failure $(CTEST_ARGS)

bench: build
	@bash bench/run.sh $(BUILD)

run: build
	@MODEL='$(MODEL)' bash tools/run.sh $(BUILD)

fuzz: deps
	@CC=clang-14 cmake -S . -B $(FUZZ_BUILD) -DSTRATA_FUZZ=ON -DSTRATA_CUDA=OFF $(werror) $(CMAKE_ARGS) >/dev/null
	@cmake --build $(FUZZ_BUILD) -j $(JOBS)
	@echo "fuzzers in $(FUZZ_BUILD)/tests/fuzz/ (run e.g. $(FUZZ_BUILD)/tests/fuzz/fuzz_file tests/fuzz/corpus/file)"

# Each fuzzer for FUZZ_SECONDS, one at a time (they share the machine's cores), its new inputs in
# a scratch corpus under $(FUZZ_BUILD)/work/ (the seeds in tests/fuzz/corpus/ stay as they are);
# a crash stops here with its input in $(FUZZ_BUILD)/work/NAME-crash-*. fuzz_upload's store lives
# in $$TMPDIR (default /tmp; a tmpfs such as /dev/shm makes its commits fast).
fuzz-run: fuzz
	@for f in $(FUZZ_BUILD)/tests/fuzz/fuzz_*; do \
	  n=$${f##*/fuzz_}; mkdir -p $(FUZZ_BUILD)/work/$$n; echo "fuzz_$$n: $(FUZZ_SECONDS) s"; \
	  $$f -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
	    -artifact_prefix=$(FUZZ_BUILD)/work/$$n- $(FUZZ_BUILD)/work/$$n tests/fuzz/corpus/$$n \
	    2>$(FUZZ_BUILD)/work/$$n.log || { tail -40 $(FUZZ_BUILD)/work/$$n.log; exit 1; }; \
	  grep -E '^stat::number_of_executed_units' $(FUZZ_BUILD)/work/$$n.log; \
	done

# cmake --install honours DESTDIR from the environment; the prefix given here wins over the one
# the build was configured with.
install: build
	DESTDIR='$(DESTDIR)' cmake --install $(BUILD) --prefix '$(PREFIX)' $(if $(COMPONENT),--component $(COMPONENT))

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(FUZZ_BUILD) $(TSAN_BUILD) $(REL_BUILD) $(CLANG_BUILD) build-gpu
