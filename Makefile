# flashtile: two commands on a fresh Debian or Ubuntu machine (root or not), no GPU needed.
#   make serve   install what is needed, then serve the site on http://127.0.0.1:8000
#   make test    install what is needed (browser included), then run the whole suite
#   make test-long   the same with the long profiles: 300 examples per property test, whole parameter grids
# What the system lacks (python3-venv, chromium) is installed with apt when that needs no password
# (root, or passwordless sudo); otherwise make stops at once and prints the command to run.
# On a CUDA machine (your own torch build already installed):  make gpu-test  (gpu-test-long)  and  make bench

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Where pip gets torch. Empty: pip's own configuration. On plain PyPI the Linux torch wheel is the
# CUDA build, which pulls several GB of nvidia-* wheels; for the small CPU build use PyTorch's index:
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
export NO_MKDOCS_2_WARNING := 1
# Byte code: pip installs without compiling (--no-compile: it would compile some 13,000 files, about 55 s of a
# 2-core machine's install, most of them never imported); Python compiles what is imported, once, into
# .venv/pycache (PYTHONPYCACHEPREFIX), which also keeps __pycache__ folders out of the checkout. The install
# imports the core once so that parallel test workers do not all compile torch at the same moment.
VENV_TARGETS := install lock browser serve build test test-long test-unit test-docs test-site lint
$(VENV_TARGETS) $(VENV)/.installed: export PYTHONPYCACHEPREFIX := $(abspath $(VENV))/pycache
$(VENV_TARGETS) $(VENV)/.installed: export PYTHONDONTWRITEBYTECODE :=

.PHONY: install lock browser serve build test test-latest test-long test-unit test-docs test-site lint gpu-test gpu-test-long bench clean

# The lock: every package the tests and the site need, at the exact version `make lock` resolved (uv pip
# compile, from pyproject.toml and constraints-cpu.txt), so two fresh machines test the same set. With
# LATEST=1 (make test-latest) the lock is ignored: the newest releases of everything but torch and triton,
# which stay at constraints-cpu.txt's versions (a torch upgrade is a deliberate commit, with its CPU wheel).
LOCK := requirements.lock
LATEST ?=
UV_VERSION := 0.13.9
$(VENV)/.installed: pyproject.toml constraints-cpu.txt $(LOCK)
	PYTHON=$(PYTHON) tools/system-deps.sh venv
	$(PYTHON) -m venv $(VENV)
ifneq ($(TORCH_INDEX),)
	$(PY) -m pip install -q --no-compile --index-url $(TORCH_INDEX) -c constraints-cpu.txt torch
endif
ifeq ($(LATEST),)
	$(PY) -m pip install -q --no-compile -r $(LOCK)
	$(PY) -m pip install -q --no-compile --no-deps -e .
else
	$(PY) -m pip install -q --no-compile --upgrade --upgrade-strategy eager -c constraints-cpu.txt -e ".[test,docs]"
endif
	$(PY) -m pip check
	$(PY) -c "import torch, triton, numpy, flashtile"
	touch $@

install: $(VENV)/.installed

# Resolve the lock again (newest releases allowed by pyproject.toml and constraints-cpu.txt) with uv; torch is
# written without its local label (+cpu), so that the same pin takes the CPU wheel from TORCH_INDEX or a
# configured wheel folder, and the CUDA wheel from plain PyPI. Before committing the new lock: make test.
lock: install
	$(PY) -m pip install -q uv==$(UV_VERSION)
	$(VENV)/bin/uv pip compile pyproject.toml --extra test --extra docs -c constraints-cpu.txt \
		$(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX) --index-strategy unsafe-best-match) \
		--python-version 3.11.7 --python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock" \
		--no-header --quiet -o $(LOCK).new
	( echo "# The exact set that make test installs (Python 3.11.7+, Linux x86_64). Written by make lock: do not edit;"; \
	  echo "# see the README (\"The lock\") for how to refresh it and what to check before committing it."; \
	  sed -E 's/^(torch==[^+ ]+)\+[a-z0-9.]+/\1/' $(LOCK).new ) > $(LOCK)
	rm $(LOCK).new
	@git diff --stat -- $(LOCK) || true

# The same suite on the newest releases (the lock ignored), in a venv of its own; what differs from the lock
# is printed first, so that a red run names the package that moved. Run weekly by .github/workflows/latest.yml.
test-latest:
	@mkdir -p artifacts
	$(SUBMAKE) install VENV=.venv-latest LATEST=1
	.venv-latest/bin/python tools/lock_diff.py $(LOCK) | tee artifacts/latest-versions.txt
	$(SUBMAKE) test VENV=.venv-latest LATEST=1

# Chromium for the browser test: Debian's, installed with apt if need be (see tools/system-deps.sh).
browser: install
	VENV_PY=$(PY) tools/system-deps.sh browser

serve: install
	$(VENV)/bin/mkdocs serve -a 127.0.0.1:8000

build: install
	$(VENV)/bin/mkdocs build --strict

# Each step fails on its own: pytest exits 5 when it collects nothing, and make stops on any non-zero.
# The browser comes first so that a machine without one stops before the long steps, not after.
# The unit tests and the docs' claims share one pytest start; the site is built once, into site/, and
# the site tests read that build (FLASHTILE_SITE_DIR), which is also what the Pages workflow deploys.
# The two run side by side: the unit tests keep two workers busy, while the site's branch (the strict
# build, then the browser, which mostly waits on page loads and MathJax) fills what they leave idle.
# The site's output goes to artifacts/site-steps.log and is shown after the unit tests' own; the run
# fails when either fails.
# (SUBMAKE, not $(MAKE) written out: so that `make -n test` prints this recipe instead of running it.)
SUBMAKE = $(MAKE) --no-print-directory
SITE_LOG := artifacts/site-steps.log
test: install browser lint
	@mkdir -p artifacts
	@echo "make test: unit tests and claims here; the site is built and tested alongside ($(SITE_LOG), shown after)"
	@start=$$(date +%s); \
	( $(SUBMAKE) test-site > $(SITE_LOG) 2>&1; \
	  status=$$?; echo "site branch: $$(( $$(date +%s) - start )) s, exit status $$status" >> $(SITE_LOG); \
	  exit $$status ) & site=$$!; \
	$(SUBMAKE) test-unit; unit=$$?; \
	echo "unit tests and claims: $$(( $$(date +%s) - start )) s, exit status $$unit"; \
	wait $$site; site=$$?; \
	echo "==== the site: strict build, then the site and browser tests ($(SITE_LOG)) ===="; \
	cat $(SITE_LOG); \
	echo "tests after the install: $$(( $$(date +%s) - start )) s"; \
	[ $$unit -eq 0 ] && [ $$site -eq 0 ]

# FLASHTILE_TEST_LONG=1: 300 examples per property test instead of 60 (the hypothesis profile of the
# root conftest), and every parameter grid whole instead of its pairwise covering (tests/_grids.py).
test-long: export FLASHTILE_TEST_LONG := 1
test-long: test

lint: install
	$(VENV)/bin/ruff check src tests bench hooks conftest.py

# --dist loadgroup: tests marked with one xdist_group run on one worker, one after the other (the gloo
# ring's process groups start once, the sm_90 kernels compile in one process), and these groups are dealt
# out first; then the single tests one at a time to whichever worker is free, the longest first (the list
# in tests/_xdist_plan.py, which also makes pytest 9.2 honour xdist_group), so both workers end together.
test-unit: install
	$(PY) -m pytest -n 2 --dist loadgroup -m "not site" --codeblocks docs tests

test-docs: install
	$(PY) -m pytest --codeblocks docs -q

test-site: install browser build
	FLASHTILE_SITE_DIR=site $(PY) -m pytest -m site tests/site

# The GPU suite: four pytest-xdist workers sharing one device (each distinct setting compiles a
# kernel of its own, on the CPU), 3 minutes on one H200 (178 s at 03eda60). gpu-test-long: the
# whole parameter grids.
gpu-test:
	PYTHONPATH=src $(PYTHON) -m pytest -m gpu tests -q -n 4 --durations=15

gpu-test-long: export FLASHTILE_TEST_LONG := 1
gpu-test-long: gpu-test

bench:
	PYTHONPATH=src $(PYTHON) -m flashtile.bench

clean:
	rm -rf $(VENV) .venv-latest site artifacts .pytest_cache .hypothesis
