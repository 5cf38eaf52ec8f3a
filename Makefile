# `make serve` and `make test` do all set-up on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
# mkdocs-material 9.8 prints a banner about its successor on every build.
export NO_MKDOCS_2_WARNING := 1

.PHONY: install serve test test-e2e lint docs model test-models regress clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned to the CPU build, so pip never resolves a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench,docs]'
	touch $(STAMP)

# The default model (fetched and converted once).
model: install
	$(VENV)/bin/lumen model path

# ... and Gemma 3 270M, for its equality test (tests/engine/test_real_gemma.py).
test-models: model
	$(VENV)/bin/lumen model path gemma-3-270m

# The OpenAI-compatible server with the default model on 127.0.0.1:8000 (ARGS for more options).
serve: model
	$(VENV)/bin/lumen serve --host 127.0.0.1 --port 8000 $(ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	# The floors of the request path (pyproject.toml [tool.importlinter]): no arrow the wrong way.
	$(VENV)/bin/lint-imports
	# Types (pyproject.toml [tool.mypy]): strict for the core, the wire messages and tracing.
	$(VENV)/bin/mypy
	# The documentation site: a broken link, a missing page or a reference that fails to
	# generate fails the build.
	d=$$(mktemp -d); $(VENV)/bin/mkdocs build --strict --quiet --site-dir "$$d"; s=$$?; \
		rm -rf "$$d"; test $$s = 0

# The documentation site (mkdocs.yml) into site/, offline; its reference pages are generated
# from the code (service/reference.py). Browse it with: python -m http.server -d site
docs: install
	$(VENV)/bin/mkdocs build --clean

# The suite in two passes (docs/development.md, "Tests"): the tests that time nothing on two workers, then
# the `serial` ones (wall-clock deadlines, provoked latency) alone, so no neighbour makes them
# flaky. Both passes run; either failing fails the target. Bytecode is cached even where the
# environment says not to (PYTHONDONTWRITEBYTECODE): every worker, server and engine core the
# suite starts would compile the project's sources again, and pytest rewrite every test module's
# asserts again, about 10 s of a 2-core run (__pycache__ is ignored by git). The passes share
# one folder for what the tests build once and only read (LUMEN_TEST_BUILD_DIR, tests/conftest.py).
test: test-models lint
	export LUMEN_TEST_BUILD_DIR=$$(mktemp -d); \
	env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/pytest -n 2 --dist loadfile --no-loadscope-reorder \
		-m "not serial and not e2e" --durations=20; a=$$?; \
	env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/pytest -m "serial and not e2e" --durations=20; b=$$?; \
	rm -rf "$$LUMEN_TEST_BUILD_DIR"; test $$a = 0 && test $$b = 0

# The end-to-end checks too long for make test (generated scenarios scored on every model we
# ship: lumen bench diagnose's sample), alone; CI runs them after make test.
test-e2e: test-models
	env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/pytest -m e2e --durations=10

# The latency regression gate CI runs after the tests (regress/README.md).
regress: model
	$(VENV)/bin/replay regress

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis .mypy_cache site
