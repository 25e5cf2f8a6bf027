# Every target sets itself up: a fresh clone needs only `make serve` or `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.afm-installed
ARGS   ?=

.PHONY: install serve test test-pure bench lint clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=70" wheel "cython==3.3.1" "nanobind==3.1.0"
	$(PY) -m pip install -q -e '.[http,test,bench]'
	# instructor 1.17.0 (a client the tests drive) pins jiter<0.15 and rich<15, which the openai
	# SDK tested here outgrew; its code runs on both, so it goes in without its pins
	$(PY) -m pip install -q --no-deps "instructor==1.17.0"
	$(PY) -m pip install -q "docstring-parser>=0.16,<1" "tenacity>=8.2.3,<10" "typer>=0.9,<1"
	touch $(STAMP)

# (Re)build the Cython accelerators in place; a no-op when they are current.
install: $(STAMP)
	$(PY) setup.py -q build_ext --inplace

serve: install
	$(VENV)/bin/afm serve $(ARGS)

test: install
	$(PY) -m pytest $(ARGS)

# The same suite on the pure-Python twins.
test-pure: install
	AFM_NO_EXTENSIONS=1 $(PY) -m pytest $(ARGS)

bench: install
	$(PY) benchmarks/stream_core.py
	$(PY) benchmarks/engine.py
	$(PY) benchmarks/serve_bench.py --interleave --rounds 3

# ruff, mypy, and the import layers (pyproject.toml [tool.importlinter]).
lint: install
	$(PY) -m pip install -q "ruff==0.17.6" "mypy==2.4.1" "import-linter==2.16"
	$(VENV)/bin/ruff check afm_core afm_http tests benchmarks
	$(VENV)/bin/mypy afm_core afm_http
	$(VENV)/bin/lint-imports --no-logo --no-cache

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis
	find afm_core -name '*.so' -delete
	find ext -maxdepth 1 -name '*.c' -delete
