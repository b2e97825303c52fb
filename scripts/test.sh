#!/usr/bin/env bash
# The README's test command: install, lint, type-check, then every test tier
# (unit, topology with the real broker and Faust, e2e with real vLLM).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "[test] ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "[test] mypy"
.venv/bin/mypy sparseety producers streams sinks
echo "[test] pytest (all tiers)"
exec .venv/bin/python -m pytest -ra "$@"
