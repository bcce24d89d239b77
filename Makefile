# Two commands on a fresh clone: `make install`, then `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install test test-gpu sweep-seed clean

# torch first, only where none is importable: a CPU machine gets torch 2.13.0 (a CPU build where one
# lies on disk); a GPU machine keeps the torch it has. --no-build-isolation keeps pip from fetching
# anything when every requirement is already there (triton==3.9.0, carried to the GPU machines: docs/usage.md).
install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "torch==2.13.0"
	$(PIP) install "setuptools>=64" wheel
	$(PIP) install --no-build-isolation -e ".[dev]"

# CPU tests (compile-only kernel tests included); GPU tests skip cleanly without a GPU.
test:
	$(PYTHON) -m pytest -q -n auto tests

test-gpu:
	$(PYTHON) -m pytest -q tests -m gpu

sweep-seed:
	gluon-attn sweep --experiment experiments/seed-table.toml --out results/seed-table

clean:
	rm -rf build *.egg-info .pytest_cache
