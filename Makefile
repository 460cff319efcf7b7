# kimi_experts: the two commands of the README, and their parts.
#
#   make demo    install what the build needs, build, run the demo (the main job)
#   make test    install the test dependencies, build, run pytest
#
# Everything installs into the Python that runs `$(PYTHON)` (no virtual environment):
# set PYTHON=... to pick another. KIMI_EXPERTS_CUDA=0 builds without the CUDA kernels;
# ARGS="--batch 8" passes flags to the demo, PYTEST_ARGS="-k dlpack" to pytest.

PYTHON ?= python3
PIP := $(PYTHON) -m pip
ARGS ?=
PYTEST_ARGS ?=
export PIP_ROOT_USER_ACTION := ignore
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test build deps test-deps clean

demo: build
	$(PYTHON) -m kimi_experts.demo $(ARGS)

# pytest exits 5 when it collects no test: not a failure when PYTEST_ARGS selected none
# (e.g. -k), but a broken suite when the whole of it was asked for.
test: test-deps build
	@$(PYTHON) -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ] && [ -n "$(PYTEST_ARGS)" ]; then echo "pytest: PYTEST_ARGS selected no tests"; exit 0; fi; exit $$rc

# What the build needs (numpy's C headers, setuptools >= 64 and wheel for editable
# installs); pip is not called when they are already there (machines without network).
deps:
	@$(PYTHON) -c "import numpy, setuptools, wheel; \
assert int(setuptools.__version__.split('.')[0]) >= 64" 2>/dev/null || \
		$(PIP) install -q "numpy>=1.23" "setuptools>=64" wheel

# torch is pinned: a bare `torch` pulls a multi-GB CUDA build. A torch that is already
# installed (e.g. a CUDA build on a GPU machine) is kept.
test-deps: deps
	@if ! $(PYTHON) -c "import torch" 2>/dev/null; then \
		$(PIP) install -q -r requirements-test.txt; \
	elif ! $(PYTHON) -c "import pytest" 2>/dev/null; then \
		$(PIP) install -q "pytest>=7"; \
	fi

# Editable install: the extension is built into kimi_experts/ in this checkout. The
# full compiler log goes to build/build.log; its decisions (CUDA or not, and why) are
# printed.
build: deps
	@mkdir -p build
	@echo "building kimi_experts (log: build/build.log)"
	@if $(PIP) install --no-build-isolation --no-deps -v -e . > build/build.log 2>&1; then \
		grep -o "kimi_experts build: .*" build/build.log | awk '!seen[$$0]++'; \
		$(PYTHON) -c "import kimi_experts as kx; i = kx.backend_info(); \
print('built:', i['build']); print('CUDA available here:', i['cuda_available'], '' if i['cuda_available'] else '(' + i['reason'] + ')')"; \
	else \
		tail -n 80 build/build.log; echo "build failed; full log: build/build.log"; exit 1; \
	fi

clean:
	rm -rf build *.egg-info kimi_experts/_C*.so
