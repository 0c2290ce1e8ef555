# flashtile: two commands on a fresh CPU machine.
#   make serve   install what is needed, then serve the site on http://127.0.0.1:8000
#   make test    install what is needed, then run the whole suite (unit, doc claims, site, browser)
# On a CUDA machine (your own torch build already installed):  make gpu-test  and  make bench

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export NO_MKDOCS_2_WARNING := 1
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: install serve build test test-unit test-docs test-site lint gpu-test bench clean

$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints-cpu.txt -e ".[test,docs]"
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/mkdocs serve -a 127.0.0.1:8000

build: install
	$(VENV)/bin/mkdocs build --strict

# Each step fails on its own: pytest exits 5 when it collects nothing, and make stops on any non-zero.
test: install lint test-unit test-docs test-site

lint: install
	$(VENV)/bin/ruff check src tests bench conftest.py

test-unit: install
	$(PY) -m pytest -n 2 -m "not site" tests

test-docs: install
	$(PY) -m pytest --codeblocks docs -q -rA

test-site: install
	$(PY) -m pytest -m site tests/site

gpu-test:
	PYTHONPATH=src $(PYTHON) -m pytest -m gpu tests -q

bench:
	PYTHONPATH=src $(PYTHON) -m flashtile.bench

clean:
	rm -rf $(VENV) site artifacts .pytest_cache .hypothesis
