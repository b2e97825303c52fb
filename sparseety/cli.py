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
    "sparseety.api.admin_cli",
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
    """Start the broker in the background and create the topics.

    In the data dir of a stack that ``up`` started, this is ``up``: the new broker's in-memory
    log is empty, so the stack's workers and store are restarted on it (a worker left on the lost
    log would exit and nothing would land until the next ``up``)."""
    b = _broker(c, port)
    from sparseety.stack.supervisor import Stack

    stack = Stack(c.cfg)
    if b.port == stack.broker.port and stack.started_parts():
        click.echo(
            f"broker: the stack in {c.cfg.data_path} runs {', '.join(stack.started_parts())}", err=True
        )
        for row in stack.up(progress=lambda t: click.echo(t, err=True)):
            click.echo(f"{row.name}: {row.state}")
        return
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


# --- analyze -----------------------------------------------------------------------------------


@main.command("analyze")
@click.argument("inputs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--output",
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Report directory (--out: its older name; one --output flag across commands).",
)
@click.option(
    "--format", "fmt", type=click.Choice(["json", "csv", "parquet"]), default="json", show_default=True
)
@click.option(
    "--input-format",
    type=click.Choice(["auto", "recording", "jsonl", "vllm-log"]),
    default="auto",
    show_default=True,
    help="Format of every input (auto: detected per file).",
)
@click.option("--clickhouse", "dsn", default=None, help="Also write into this ClickHouse DSN (chdb:// too).")
@click.option("--database", default=None, help="Database of --clickhouse [the configured one].")
@click.option("--retries", type=click.IntRange(min=0), default=1, show_default=True, help="Per failed input.")
@click.option("--tenant", default="", help="Tenant of log/JSONL requests that name none.")
@click.option("--model", default="", help="Model of log/JSONL requests that name none [vllm-log for logs].")
@click.option(
    "--log-year", type=int, default=None, help="Year of a vLLM log's dates [its file's mtime year]."
)
@click.option(
    "--log-utc-offset", type=int, default=0, show_default=True, help="vLLM log clock offset, minutes."
)
@click.option("--max-log-len", type=int, default=None, help="The server's --max-log-len, if it had one.")
@pass_ctx
def analyze_cmd(
    c: CliContext,
    inputs: tuple[str, ...],
    out_dir: str,
    fmt: str,
    input_format: str,
    dsn: str | None,
    database: str | None,
    retries: int,
    tenant: str,
    model: str,
    log_year: int | None,
    log_utc_offset: int,
    max_log_len: int | None,
) -> None:
    """Fold trace files (recordings, JSONL, vLLM logs) offline: a report per input plus a summary.

    No Kafka and no running stack. Resumable: inputs finished in an earlier run into the same
    --out are skipped. Exit status 1 when an input failed (the others are still analysed).
    """
    from sparseety.offline.analyze import Options, analyze

    err = click.get_text_stream("stderr")
    with click.progressbar(length=len(inputs), label="analysing", file=err) as bar:

        def progress(done: int, total: int, name: str) -> None:
            bar.length = total
            bar.label = f"analysing {name}" if name else "analysed"
            bar.update(done - bar.pos)

        summary = analyze(
            c.cfg,
            list(inputs),
            out_dir,
            fmt=fmt,
            opts=Options(input_format, tenant, model, log_year, log_utc_offset * 60, max_log_len),
            clickhouse_dsn=dsn,
            clickhouse_database=database,
            retries=retries,
            progress=progress,
        )
    for line in summary.inputs:
        extra = f" ({line['error']})" if line.get("error") else ""
        click.echo(f"{line['input']}: {line['status']}{extra}, {line.get('requests', 0)} requests")
    t = summary.totals
    click.echo(
        f"total: {t['requests']} requests ({len(summary.duplicates)} duplicates not counted), "
        f"{t['prompt_tokens']} prompt + {t['output_tokens']} output tokens; reports in {out_dir}"
    )
    if summary.failed:
        raise SystemExit(1)


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
