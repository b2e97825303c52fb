"""The SGLang general plugin: ``register()`` is the ``sglang.srt.plugins`` entry point.

SGLang (0.5.23) calls ``load_plugins()`` early in every process it starts: the launcher, each
scheduler process (``run_scheduler_process``), the detokenizer, the data-parallel controller.
``register()`` does nothing unless SparSEEty is configured (``SPARSEETY_CONFIG`` or
``SPARSEETY_KAFKA_BOOTSTRAP``, the vLLM plugin's rule); otherwise it registers post-import hooks
(wrapt) for SGLang's scheduler modules, so nothing is patched until SGLang imports them in that
process and only the scheduler process ever gets the hooks. ``SGLANG_PLUGINS`` (SGLang's
allow-list) can also leave it out. ``register()`` never raises.
"""

from __future__ import annotations

import logging

from ..plugin_kit import register_when_configured

log = logging.getLogger("sparseety.producer.sglang")


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group; never raises."""
    register_when_configured(
        _install, log, "sparseety: SGLang hooks not loaded, the engine runs without them: %r"
    )


def _install() -> None:
    from . import hooks

    hooks.install()
