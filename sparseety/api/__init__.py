"""The HTTP API, its jobs and the dashboard (``docs/api.md``, ``docs/dashboard.md``).

Served by the process that owns the store: ``sparseety store`` (the sink loop and the API in one
process) or ``sparseety api`` (the API alone). Modules import FastAPI and the store lazily where
they can, so ``sparseety --help`` stays cheap.
"""
