# Two commands for a fresh machine: `make bench` and `make test`.
# Both create .venv if missing, install the pinned stack, build metamat._C, then run.
PY        ?= python3
VENV      := .venv
VPY       := $(VENV)/bin/python
STAMP     := $(VENV)/.metamat-deps
TORCH_VER := 2.13.0
# Where a CUDA torch is already installed (a GPU machine), the venv sees it instead of
# installing the CPU wheel.
HAS_CUDA_TORCH := $(shell $(PY) -c "import torch,sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null && echo 1)

.PHONY: setup build test bench sanitize clean

$(STAMP): requirements-dev.txt constraints.txt Makefile
ifeq ($(HAS_CUDA_TORCH),1)
	test -x $(VPY) || $(PY) -m venv --system-site-packages $(VENV)
	$(VPY) -m pip install -q -r requirements-dev.txt
else
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip setuptools wheel
	$(VPY) -m pip install -q torch==$(TORCH_VER) -c constraints.txt
	$(VPY) -m pip install -q -c constraints.txt fbgemm-gpu-cpu==1.8.0 tensordict torchmetrics==1.0.3 pyre-extensions iopath
	$(VPY) -m pip install -q --no-deps torchrec==1.8.0
	$(VPY) -m pip install -q -c constraints.txt -r requirements-dev.txt cmake ninja
endif
	touch $(STAMP)

setup: $(STAMP)

build: setup
	$(VPY) -m pip install -q --no-build-isolation --no-deps -e .

test: build
	$(VPY) -m pytest -q

bench: build
	$(VPY) bench/materialize.py

clean:
	rm -rf build metamat/_C*.so *.egg-info
