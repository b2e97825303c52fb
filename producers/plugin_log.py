"""The engine plugins' logging: the one piece the vLLM and SGLang plugins share about it."""

from __future__ import annotations

import logging


def ensure_log_handler() -> None:
    """Show our INFO lines beside vLLM's when the application configured no logging."""
    root = logging.getLogger("sparseety")
    if root.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter("(%(processName)s pid=%(process)d) %(levelname)s %(name)s: %(message)s")
    )
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False  # a root handler configured later would print every line twice
