# Two commands for a fresh machine: `make bench` and `make test`.
# Both create .venv if missing, install the pinned stack, build metamat._C, then run.
# On a machine whose python3 already imports a CUDA torch (a GPU box, maybe offline) they use
# that interpreter as it is instead: no venv, no pip, no network (GPU machines, below).
PY        ?= python3
VENV      := .venv
VPY       := $(VENV)/bin/python
STAMP     := $(VENV)/.metamat-deps
# Each CPU stack is one constraints file (torch, fbgemm-gpu-cpu, torchrec and the test tools):
# constraints.txt, the default (.venv: `make test`, `make bench`), the newest release that works;
# constraints-compat.txt, the older one CI also runs (.venv-compat: `make test-compat`).
CVENV     := .venv-compat
CVPY      := $(CVENV)/bin/python
CSTAMP    := $(CVENV)/.metamat-deps
HAS_CUDA_TORCH := $(shell $(PY) -c "import torch,sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null && echo 1)
# Independent tests run in TEST_JOBS processes on the CPU stacks (pytest-xdist; TEST_JOBS=0:
# one). Measured on 2 cores (AMD EPYC Zen 4): 1,476 tests in 348 s with -n 2; a fresh clone's
# `make test`, set-up and build included, in 8 min 6 s.
TEST_JOBS ?= auto

.PHONY: setup build test bench sanitize clean setup-compat test-compat

# install_stack VENV CONSTRAINTS BACKGROUND: the build tools, then BACKGROUND (a command; the
# default venv builds metamat._C there, on the core pip leaves idle) while pip installs torch,
# fbgemm-gpu-cpu and torchrec's small deps, torchrec --no-deps (its metadata wants the CUDA
# fbgemm-gpu wheel), then the test tools; every step under the same constraints, so nothing
# moves torch. Prints what it got. (pip compiles every module, which is needed: where
# PYTHONDONTWRITEBYTECODE=1 is set, as here, no run would keep what it compiles.)
define install_stack
	test -x $(1)/bin/python || $(PY) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip setuptools wheel
	$(1)/bin/python -m pip install -q -c $(2) -r requirements-build.txt
	mkdir -p build; bglog=build/background-$(subst .,,$(notdir $(1))).log; \
	( $(3) ) > $$bglog 2>&1 & bg=$$!; \
	$(1)/bin/python -m pip install -q -c $(2) torch \
	&& $(1)/bin/python -m pip install -q -c $(2) fbgemm-gpu-cpu tensordict torchmetrics pyre-extensions iopath \
	&& $(1)/bin/python -m pip install -q -c $(2) --no-deps torchrec \
	&& $(1)/bin/python -m pip install -q -c $(2) -r requirements-dev.txt; rc=$$?; \
	if ! wait $$bg; then echo "failed: $(3) (its log, $$bglog:)"; tail -n 40 $$bglog; exit 1; fi; \
	exit $$rc
	$(1)/bin/python -c "import torch, fbgemm_gpu, torchrec as r; print('$(1):', torch.__version__, fbgemm_gpu.__version__, r.__version__)"
	touch $(1)/.metamat-deps
endef

ifeq ($(HAS_CUDA_TORCH),1)
# ---- GPU machines: $(PY) has CUDA torch, pybind11, cmake, pytest (nothing is installed) ----
# The extension is built in place by CMake (scripts/build_ext.py) for this GPU's architecture
# (both 80 and 90 when none is visible); tests and bench run from the tree with $(PY).
CUDA_ARCHS  ?= $(shell $(PY) -c "import torch; c = torch.cuda.get_device_capability() if torch.cuda.is_available() else None; print(f'{c[0]}{c[1]}' if c else '80;90')" 2>/dev/null)
# a test module whose optional package is missing here is reported, the others still run
PYTEST_ARGS ?= --continue-on-collection-errors
BENCH_ARGS  ?=

setup:
	@$(PY) -c "import sys, torch, pybind11, numpy, pytest; print('using', sys.executable, 'torch', torch.__version__, 'CUDA', torch.version.cuda)"

build: setup
	METAMAT_CUDA_ARCHS="$(CUDA_ARCHS)" $(PY) scripts/build_ext.py

test: build
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: build
	PYTHONPATH=$(CURDIR) $(PY) bench/materialize.py $(BENCH_ARGS)
else
# ---- a fresh machine: .venv with the pinned CPU stack ----------------------------------------
$(STAMP): requirements-dev.txt requirements-build.txt constraints.txt Makefile
	$(call install_stack,$(VENV),constraints.txt,$(VPY) setup.py -q build_ext --inplace)

setup: $(STAMP)

build: setup
	$(VPY) -m pip install -q --no-build-isolation --no-deps -e .

test: build
	$(VPY) -m pytest -q -n $(TEST_JOBS)

bench: build
	$(VPY) bench/materialize.py --out bench_out
endif

clean:
	rm -rf build metamat/_C*.so *.egg-info

# ---- the second stack: `make test-compat` (CI runs it after `make test`) ---------------------
# The TorchRec tests (`-m torchrec`: tests/conftest.py marks every test that builds or reads
# TorchRec/fbgemm objects) on constraints-compat.txt in .venv-compat. metamat._C is torch-free
# (pybind11 and the C++ runtime only), so the one in metamat/ serves both venvs (the same
# Python); it is built here (build/compat) only when missing or older than its sources.
# metamat itself is imported from the tree (PYTHONPATH).
COMPAT_ARGS ?=
EXT         := metamat/_C$(shell $(PY) -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")

$(CSTAMP): requirements-dev.txt requirements-build.txt constraints-compat.txt Makefile
	$(call install_stack,$(CVENV),constraints-compat.txt,true)

setup-compat: $(CSTAMP)

$(EXT): $(shell find csrc -type f) CMakeLists.txt | $(CSTAMP)
	METAMAT_BUILD_DIR=build/compat $(CVPY) scripts/build_ext.py

test-compat: setup-compat $(EXT)
	PYTHONPATH=$(CURDIR) $(CVPY) -m pytest -q -n $(TEST_JOBS) -m torchrec $(COMPAT_ARGS)

# ---- the GPU machine's TorchRec stack on a CPU: `make test-gpustack` (by hand, not in CI) -----
# torch 2.11 + fbgemm-gpu-cpu 1.6.0 + torchrec 1.6.1 (constraints-gpustack.txt): the versions
# scripts/gpu_torchrec_stack.sh packs for the lent GPU machine, whose CUDA fbgemm-gpu 1.6.0 has
# the same Python. The TorchRec tests here, before a GPU run, catch what that older stack
# breaks (its `cuda` tests skip). PyPI's torch 2.11 is a CUDA build: a 5.6 GiB venv that runs
# on the CPU. Measured (Intel Xeon Ice Lake, 2 cores): install ~4 min, tests ~4 min.
GVENV  := .venv-gpustack
GVPY   := $(GVENV)/bin/python
GSTAMP := $(GVENV)/.metamat-deps

$(GSTAMP): requirements-dev.txt requirements-build.txt constraints-gpustack.txt Makefile
	$(call install_stack,$(GVENV),constraints-gpustack.txt,true)

.PHONY: test-gpustack
test-gpustack: $(GSTAMP)
	$(MAKE) --no-print-directory $(EXT) CSTAMP=$(GSTAMP) CVPY=$(GVPY)  # built by this venv
	PYTHONPATH=$(CURDIR) $(GVPY) -m pytest -q -n $(TEST_JOBS) -m torchrec $(COMPAT_ARGS)

# `make docs`: the API reference (Sphinx: docs/api) as HTML in build/docs; warnings are errors.
.PHONY: docs
DOCS_PY := $(if $(HAS_CUDA_TORCH),$(PY),$(VPY))
docs: setup
	$(DOCS_PY) -m sphinx -W --keep-going -q -b html docs/api build/docs
	@echo "API reference: build/docs/index.html"

# ---- reliability: sanitizers and fuzzing (fresh machines: they need .venv) --------------------
.PHONY: fuzz
# `make sanitize`: builds the C++ core with ASan + UBSan into build/sanitize (CUDA off) and runs
# the tests that execute it against a copy of the package in build/sanitize/tree, so the
# normal metamat/_C*.so is never touched. libasan must come first in the process: LD_PRELOAD.
SAN_DIR   := build/sanitize
SAN_TREE  := $(SAN_DIR)/tree
SAN_TESTS ?= tests/test_fill_reference.py tests/test_fill_invariance.py tests/test_fill_errors.py \
             tests/test_checkpoint_reader.py tests/test_load.py tests/test_reader_faults.py \
             tests/test_checkpoint_dcp.py tests/test_hostile.py tests/test_stage_pipeline.py \
             tests/test_fill_cuda_emulated.py tests/test_reader_tasks.py tests/test_stage_pool.py \
             tests/test_graph_scan.py
SAN_ENV   := LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
             ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1:detect_odr_violation=0 \
             UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1

sanitize: setup
	cmake -S . -B $(SAN_DIR) -G Ninja -DPython_EXECUTABLE=$(abspath $(VPY)) \
	  -Dpybind11_DIR="$$($(VPY) -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
	  -DMETAMAT_CUDA=OFF -DMETAMAT_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_CXX_FLAGS="-fno-sanitize-recover=undefined"
	cmake --build $(SAN_DIR)
	rm -rf $(SAN_TREE) && mkdir -p $(SAN_TREE)
	cp -r metamat tests fuzz bench pyproject.toml $(SAN_TREE)/
	rm -f $(SAN_TREE)/metamat/_C*.so && cp $(SAN_DIR)/_C*.so $(SAN_TREE)/metamat/
	cd $(SAN_TREE) && $(SAN_ENV) $(abspath $(VPY)) -c \
	  "import metamat, metamat._C as C, os; assert os.path.realpath(C.__file__).startswith(os.getcwd()), C.__file__"
	cd $(SAN_TREE) && $(SAN_ENV) $(abspath $(VPY)) -m pytest -q -p no:cacheprovider \
	  -k "not fuzz" $(SAN_TESTS)

# `make fuzz`: FUZZ_TIME seconds per harness (atheris: safetensors header, torch.save zip/pickle,
# DCP chunk locator, the restricted unpicklers, the object-graph walk; libFuzzer: the C++
# reader's op validation). Corpus and crash artifacts stay in build/fuzz; a crash stops the
# target with the reproducer's path printed.
FUZZ_TIME ?= 300
FUZZ_DIR  := build/fuzz
CLANGXX   ?= $(shell command -v clang++ 2>/dev/null)
# The reader and the staging pipeline (csrc/io, csrc/stage; no pybind11, CUDA stand-in).
FUZZ_IO_SRC = $(wildcard csrc/io/*.cpp csrc/stage/*.cpp)
FUZZ_INC    = -Icsrc/include -Icsrc

fuzz: build
	mkdir -p $(FUZZ_DIR)/corpus/read_ops
	$(VPY) fuzz/seeds.py $(FUZZ_DIR)/corpus
	rm -rf $(FUZZ_DIR)/tmp
	for h in safetensors torch_save dcp pickle; do \
	  METAMAT_FUZZ_TMP=$(FUZZ_DIR)/tmp $(VPY) fuzz/fuzz_$$h.py -max_total_time=$(FUZZ_TIME) -timeout=20 -print_final_stats=1 \
	    -artifact_prefix=$(FUZZ_DIR)/$$h- $(FUZZ_DIR)/corpus/$$h || exit 1; done
	mkdir -p $(FUZZ_DIR)/corpus/graph  # the object-graph walk; malloc: a freed read crashes
	METAMAT_FUZZ_TMP=$(FUZZ_DIR)/tmp PYTHONMALLOC=malloc $(VPY) fuzz/fuzz_graph.py \
	  -max_total_time=$(FUZZ_TIME) -timeout=20 -print_final_stats=1 \
	  -artifact_prefix=$(FUZZ_DIR)/graph- $(FUZZ_DIR)/corpus/graph
ifneq ($(CLANGXX),)
	$(CLANGXX) -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined \
	  -fno-sanitize-recover=undefined $(FUZZ_INC) fuzz/fuzz_read_ops.cpp $(FUZZ_IO_SRC) \
	  -o $(FUZZ_DIR)/fuzz_read_ops -lpthread
	$(FUZZ_DIR)/fuzz_read_ops -max_total_time=$(FUZZ_TIME) -print_final_stats=1 \
	  -artifact_prefix=$(FUZZ_DIR)/read_ops- $(FUZZ_DIR)/corpus/read_ops
else
	@echo "clang++ not found: running the C++ reader harness unguided (g++, ASan+UBSan)"
	g++ -std=c++17 -g -O1 -DMETAMAT_FUZZ_STANDALONE -fsanitize=address,undefined \
	  -fno-sanitize-recover=undefined $(FUZZ_INC) fuzz/fuzz_read_ops.cpp $(FUZZ_IO_SRC) \
	  -o $(FUZZ_DIR)/fuzz_read_ops -lpthread
	$(FUZZ_DIR)/fuzz_read_ops $$(( $(FUZZ_TIME) * 2000 ))
endif
