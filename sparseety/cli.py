"""The ``sparseety`` command line.

Each command reads the configuration once (``--config`` / ``SPARSEETY_CONFIG`` + ``SPARSEETY_*``),
then hands a frozen :class:`~sparseety.config.Config` to the component. Components are imported
inside their command, so ``sparseety broker status`` does not pay for importing Faust or vLLM.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from sparseety import __version__
from sparseety.cli_context import CliContext, pass_ctx
from sparseety.config import to_toml
from sparseety.errors import SparseetyError
from sparseety.private_dir import private_umask

#: Modules that define ``COMMANDS`` (a list of click commands) to mount on ``sparseety``.
#: They must import only click and the core package at module level.
COMPONENT_CLIS = (
    "sparseety.producers.cli",
    "sparseety.streams.cli",
    "sparseety.sinks.cli",
    "sparseety.stack.cli",
    "sparseety.api.cli",
)


class _Group(click.Group):
    """Turns SparseetyError into a one-line message and exit code 2 instead of a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except SparseetyError as exc:
            click.secho(f"error: {exc}", fg="red", err=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="sparseety")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML configuration file.")
@click.option("--data-dir", type=click.Path(file_okay=False), help="Data directory (default ~/.sparseety).")
@click.pass_context
def main(ctx: click.Context, config_path: str | None, data_dir: str | None) -> None:
    """SparSEEty: token-level accounting for LLM serving fleets."""
    private_umask()  # the data dir, chDB's store and every child process's files stay private
    overrides: dict[str, Any] = {}
    if data_dir:
        overrides["data_dir"] = data_dir
    ctx.obj = CliContext(config_path, overrides)


@main.group()
def config() -> None:
    """Inspect the configuration."""


@config.command("show")
@pass_ctx
def config_show(c: CliContext) -> None:
    """Print the effective configuration as TOML (secrets masked), defaults and overrides applied."""
    click.echo(f"# effective ClickHouse DSN: {c.cfg.clickhouse_dsn}")
    click.echo(to_toml(c.cfg), nl=False)


# --- broker ------------------------------------------------------------------------------------


@main.group()
def broker() -> None:
    """The embedded Kafka-protocol broker (Tansu) for one-machine stacks."""


def _broker(c: CliContext, port: int | None) -> Any:
    from sparseety.broker import EmbeddedBroker

    cfg = c.cfg
    if port is not None:
        cfg = cfg.replace(broker={**cfg.broker.model_dump(), "port": port})
    return EmbeddedBroker(cfg)


@broker.command("start")
@click.option("--port", type=int, help="Port to listen on (default from config: 19092).")
@pass_ctx
def broker_start(c: CliContext, port: int | None) -> None:
    """Start the broker in the background and create the topics."""
    b = _broker(c, port)
    st = b.start()
    click.echo(f"broker running: pid {st.pid}, bootstrap {st.bootstrap}, log {st.log}")
    click.echo(f"topics: {', '.join(b.cfg.topics.all())} ({b.cfg.topics.partitions} partitions)")


@broker.command("stop")
@click.option("--port", type=int)
@pass_ctx
def broker_stop(c: CliContext, port: int | None) -> None:
    """Stop the broker (its in-memory data is gone afterwards)."""
    click.echo("broker stopped" if _broker(c, port).stop() else "broker was not running")


@broker.command("status")
@click.option("--port", type=int)
@pass_ctx
def broker_status(c: CliContext, port: int | None) -> None:
    """Say whether the broker runs and answers; exit 1 when it does not."""
    st = _broker(c, port).status()
    state = "ready" if st.ready else ("running, not answering" if st.running else "stopped")
    click.echo(f"broker {state}: bootstrap {st.bootstrap}, pid {st.pid or '-'}, log {st.log}")
    sys.exit(0 if st.ready else 1)


def _mount_components() -> None:
    for name in COMPONENT_CLIS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):  # no such component (yet); else a real bug
                continue
            raise
        for command in module.COMMANDS:
            main.add_command(command)


_mount_components()

if __name__ == "__main__":  # pragma: no cover
    main()
