# amk: the two commands of the README quickstart.
#   make demo   set up .venv if missing, then `amk doctor`, `amk compile smollm2-135m --tp 2` and
#               `amk generate ... --tp 2 --verify` (sim backend) on the real
#               SmolLM2-135M-Instruct checkpoint ("The capital of France is" -> " Paris...")
#   make test   set up .venv if missing, then the CPU test suite (GPU tests are listed as skipped)
#   make lint   the import contracts of pyproject.toml (lint-imports; docs/layout.md)
# VENV=path picks another virtual environment (.ci/run uses a fresh one).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test lint

# The console script is the stamp: a missing venv, or a newer pyproject.toml, reruns setup.
$(VENV)/bin/amk: pyproject.toml scripts/setup_env.sh
	AMK_VENV="$(VENV)" bash scripts/setup_env.sh
	touch "$@"

setup: $(VENV)/bin/amk

demo: setup
	$(VENV)/bin/amk doctor
	$(VENV)/bin/amk compile smollm2-135m --tp 2 --backend sim --out build/smollm2-135m-tp2
	$(VENV)/bin/amk generate smollm2-135m --prompt "The capital of France is" --max-new-tokens 32 --tp 2 --backend sim --verify

# -ra lists skipped tests (gpu/multigpu without GPUs) with their reasons. Exit code 5 (no
# tests collected) is reported and fails the target: the suite must always run real tests.
test: setup
	@rc=0; $(PY) -m pytest -ra -q -n 2 --timeout=900 --durations=15 $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

# Imports point down the layers of docs/layout.md (also checked by tests/test_layers.py).
lint: setup
	$(VENV)/bin/lint-imports --no-cache
