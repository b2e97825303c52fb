"""What every ``sparseety`` subcommand shares: the lazily loaded configuration.

Component folders define their own click commands (``streams/cli.py``, ``sinks/cli.py``, ...)
and take the configuration with ``@pass_ctx``; ``sparseety/cli.py`` mounts them.
"""

from __future__ import annotations

import os
from typing import Any

import click

from sparseety.config import Config, load_config
from sparseety.private_dir import tighten


class CliContext:
    """Holds the ``--config`` / ``--data-dir`` choices and loads the configuration on first use."""

    def __init__(self, config_path: str | None, overrides: dict[str, Any]) -> None:
        self.config_path = config_path
        self.overrides = overrides
        self._cfg: Config | None = None

    @property
    def cfg(self) -> Config:
        """The configuration: file + ``SPARSEETY_*`` environment + command-line overrides."""
        if self._cfg is None:
            self._cfg = load_config(self.config_path, env=os.environ, **self.overrides)
            # what an earlier version (or chDB under a wider umask) left readable
            tighten(self._cfg.data_path)
        return self._cfg


pass_ctx = click.make_pass_decorator(CliContext)
