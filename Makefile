# Quick start: `make demo` and `make test`. Both create/update .venv and install what they need.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed-stamp
# torch_npu's wheel is unpacked only to *read* its API docs (npufuse api); it is never imported.
# It goes to its own folder, not site-packages: its torch backend entry point would make every
# `import torch` try to load the CANN runtime and fail. npufuse api finds it via NPUFUSE_TORCH_NPU_PATH.
TORCH_NPU := torch-npu==2.14.0
TORCH_NPU_DOCS := $(VENV)/torch-npu-docs
# transformers' modeling files are the real-world corpus for the apply acceptance tests and the
# scan benchmark. Kept in its own folder (tests put it on sys.path); --no-deps because its
# optional `kernels` dependency is not on every package mirror; no weights are ever downloaded.
TRANSFORMERS_SITE := $(VENV)/transformers-site
TRANSFORMERS := transformers==5.25.0
TRANSFORMERS_DEPS := "huggingface-hub>=2.4,<3" "tokenizers>=0.23.1,<0.24" "safetensors>=0.8" regex tqdm typer
# accelerate and peft: their NPU probes run under npufuse.emulate.install() (tests/test_emulate_install_probes.py).
# --no-deps, so their torch requirement can never pull a torch build; psutil is the one dependency
# the folder and the venv lack (numpy, packaging, pyyaml, tqdm, huggingface-hub, safetensors are there).
ACCELERATE_PEFT := accelerate==1.15.0 peft==0.21.2 psutil==7.2.2

.PHONY: venv demo test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml constraints-dev.txt
	$(PIP) install -q -c constraints-dev.txt torch==2.13.0 numpy
	$(PIP) install -q -c constraints-dev.txt -e '.[dev]'
	$(PIP) install -q --no-deps --upgrade --target $(TORCH_NPU_DOCS) $(TORCH_NPU)
	$(PIP) install -q --no-deps --upgrade --target $(TRANSFORMERS_SITE) $(TRANSFORMERS)
	$(PIP) install -q --upgrade --target $(TRANSFORMERS_SITE) $(TRANSFORMERS_DEPS)
	$(PIP) install -q --no-deps --upgrade --target $(TRANSFORMERS_SITE) $(ACCELERATE_PEFT)
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	NPUFUSE_TORCH_NPU_PATH=$(TORCH_NPU_DOCS) $(PY) -m npufuse demo

# -n auto: one pytest worker per core (xdist). Most of the suite waits on subprocesses it starts
# (verify runs, scans, torch imports); two workers on the 2-core CI machine keep it well under 15 min.
test: $(STAMP)
	NPUFUSE_TORCH_NPU_PATH=$(TORCH_NPU_DOCS) $(PY) -m pytest -q -n auto

bench: $(STAMP)
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) demo-out .npufuse
