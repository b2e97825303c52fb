#!/usr/bin/env bash
# The README's test command: install, lint, type-check, then every test tier
# (unit, topology with the real broker and Faust, chaos, security, harness, e2e with real vLLM and SGLang).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "[test] ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "[test] mypy"
.venv/bin/mypy sparseety producers streams sinks
echo "[test] pytest (all tiers, ${SPARSEETY_TEST_WORKERS:-2} processes)"
# Two pytest-xdist workers: files are the unit of distribution, and the real-engine tests all run
# in one of them (tests/conftest.py schedules them together), so engines start once and the other worker
# runs the broker-, Faust- and chDB-bound tiers meanwhile. SPARSEETY_TEST_WORKERS=0 runs serially.
exec .venv/bin/python -m pytest -ra -n "${SPARSEETY_TEST_WORKERS:-2}" --durations=30 "$@"
