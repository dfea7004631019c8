# Two commands: `make run` (execute every chapter headless) and `make test` (the whole test suite).
# Both create .venv and install the lab into it first when needed (Python 3.10-3.13: PYTHON=python3.12 picks one).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONSTRAINTS ?= constraints.txt
PIP := $(PY) -m pip install -q --disable-pip-version-check
# Where the install takes torch from (README "Install"; after a change: rm $(STAMP) and make install again):
#   auto (default)  no NVIDIA GPU listed by `nvidia-smi -L`: as cpu; one listed: as pypi
#   cpu             the CPU build from TORCH_CPU_INDEX (where that index has none for this Python or cannot be
#                   reached, the install says so and takes PyPI's build)
#   pypi            PyPI's torch: the CUDA build on Linux x86_64 (with its nvidia-* and triton wheels)
#   <URL>           a package index (PEP 503) holding torch, e.g. https://download.pytorch.org/whl/cu126
#   <folder>        a folder of torch wheels (pip --find-links), e.g. one holding torch-2.13.0+cpu-*.whl
TORCH_INDEX ?= auto
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# pytest's own -q unless ARGS sets the verbosity (-q twice drops pytest's closing "N passed" line)
PYTEST_Q = $(if $(filter -q -qq -qqq --quiet -v -vv -vvv --verbose,$(ARGS)),,-q)

.PHONY: install torch run test test-fast test-browser test-pythons gpu-check lab lint bench clean

$(STAMP): pyproject.toml setup.py $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	@$(MAKE) --no-print-directory torch VENV=$(VENV) TORCH_INDEX=$(TORCH_INDEX)
	$(PIP) -c $(CONSTRAINTS) -e ".[dev]"
	touch $(STAMP)

# torch alone, from the source TORCH_INDEX names (the install above runs it first; pip then keeps that torch)
torch:
	@src="$(TORCH_INDEX)"; \
	if [ "$$src" = auto ]; then \
	  if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then src=pypi; else src=cpu; fi; \
	fi; \
	case "$$src" in \
	  pypi) echo "torch: PyPI's build (TORCH_INDEX=$(TORCH_INDEX))";; \
	  cpu) echo "torch: the CPU build from $(TORCH_CPU_INDEX) (TORCH_INDEX=$(TORCH_INDEX))"; \
	    $(PIP) --no-deps -c $(CONSTRAINTS) --index-url "$(TORCH_CPU_INDEX)" torch 2>/dev/null \
	      || echo "torch: no CPU build for this Python at $(TORCH_CPU_INDEX) (or it cannot be reached): PyPI's build instead";; \
	  *://*) echo "torch: from the index $$src"; $(PIP) --no-deps -c $(CONSTRAINTS) --index-url "$$src" torch;; \
	  *) if [ ! -d "$$src" ]; then \
	       echo "TORCH_INDEX=$$src: must be auto, cpu, pypi, an index URL or a folder of wheels"; exit 2; fi; \
	     echo "torch: from the wheels in $$src"; \
	     $(PIP) --no-deps -c $(CONSTRAINTS) --no-index --find-links "$$src" torch;; \
	esac

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/labkit run $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_Q) $(ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest $(PYTEST_Q) -m "not slow" $(ARGS)

# every Python 3.10-3.13 found here: a fresh venv each, install, chapter 00, a test subset; one line per Python.
# RESOLVE=1: pip's resolution only (no venv contents installed: what CI runs). .ci/test-pythons --help
test-pythons:
	.ci/test-pythons $(if $(RESOLVE),--resolve-only) $(ARGS)

# the real-browser test: JupyterLab headless + Playwright on Debian's Chromium (apt-get install -y chromium);
# installs the [browser] extra into .venv first; screenshots land in runs/browser/
test-browser: $(STAMP)
	$(PIP) -c $(CONSTRAINTS) -e ".[browser]"
	LABKIT_BROWSER=1 $(PY) -m pytest $(PYTEST_Q) tests/browser $(ARGS)

# the GPU check on this machine's own python3 and CUDA torch (nothing installed; skips where no GPU)
gpu-check:
	PYTHONPATH=. python3 -m labkit.gpu_check $(ARGS)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) notebooks/

lint: $(STAMP)
	$(VENV)/bin/ruff check labkit tests benchmarks

bench: $(STAMP)
	@rc=0; for b in benchmarks/*.py; do case $$b in *record_gpu_*) continue;; esac; echo "== $$b"; \
		$(PY) $$b || { echo "!! $$b missed its goal or failed"; rc=1; }; done; exit $$rc

clean:
	rm -rf $(VENV) runs .pytest_cache
