# Two commands: `make run` (execute every chapter headless) and `make test` (the whole test suite).
# Both create .venv and install the lab into it first when needed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test test-fast test-browser gpu-check lab lint bench clean

$(STAMP): pyproject.toml setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/labkit run $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(ARGS)

# the real-browser test: JupyterLab headless + Playwright on Debian's Chromium (apt-get install -y chromium);
# installs the [browser] extra into .venv first; screenshots land in runs/browser/
test-browser: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[browser]"
	LABKIT_BROWSER=1 $(PY) -m pytest -q tests/browser $(ARGS)

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
