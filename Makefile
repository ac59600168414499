# The two commands of the README: `make demo` and `make test`. Each sets up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
OUT ?= demo-output
TORCH ?= torch==2.14.1 torchvision==0.29.1

.PHONY: demo test quick lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m divtrace.demo --out $(OUT)

lint: $(VENV)/.installed
	$(PY) -m ruff check divtrace tests benchmarks docs
	$(PY) -m mypy

test: lint
	$(PY) -m pytest

# While working: the suite without the tests marked slow (CI runs them all).
quick: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow"

bench: $(VENV)/.installed
	$(PY) -m benchmarks overhead

clean:
	rm -rf $(VENV) $(OUT)
