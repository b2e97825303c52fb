"""``sparseety up | down | status | demo``: the embedded stack on one machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from sparseety.cli_context import CliContext, pass_ctx


def _say(text: str) -> None:
    click.echo(text, err=not text.startswith(("\n", "SparSEEty")))


def _print_status(rows: list) -> None:  # type: ignore[type-arg]
    width = max(len(r.name) for r in rows)
    click.echo(f"{'part':<{width}}  {'state':<9}  {'pid':>7}  endpoint")
    for r in rows:
        click.echo(f"{r.name:<{width}}  {r.state:<9}  {r.pid or '-':>7}  {r.endpoint}")
    click.echo(f"logs: {rows[0].log.parent}")


def _print_engines(c: CliContext, *, store_up: bool) -> bool:
    """The engines: their delivery states and undelivered spill journals under the data dir, and
    (while the store runs) each engine's newest finished request (sparseety/stack/engines.py).
    Returns whether an engine is not delivering."""
    import time

    from sparseety.producers.delivery import read_states
    from sparseety.stack.engines import engine_rows, journals

    stored: list[dict[str, object]] = []
    if store_up:
        from sparseety.api.client import RemoteQueries

        try:
            with RemoteQueries.from_config(c.cfg) as remote:
                stored = remote.engines()
        except Exception as exc:  # status reports what it can
            click.echo(f"engines: the store did not answer ({exc})")
    rows = engine_rows(
        journals(c.cfg.spill_path),
        stored,
        bootstrap=c.cfg.kafka.bootstrap,
        now_ns=time.time_ns(),
        deliveries=read_states(c.cfg.spill_path),
    )
    click.echo(f"\nengines (spill journals under {c.cfg.spill_path}; requests in the store):")
    if not rows:
        click.echo("  none seen")
        return False
    from sparseety.sinks.output import render

    click.echo(render(rows, "table"))
    return any(r["state"] == "silent: not delivering" for r in rows)


@click.command("up")
@click.option("--workers", default=1, show_default=True, help="Assembler workers (one consumer group).")
@pass_ctx
def up(c: CliContext, workers: int) -> None:
    """Start the embedded stack: broker, assembler worker(s), store process (sink + HTTP API)."""
    from sparseety.stack.supervisor import Stack

    stack = Stack(c.cfg, workers=workers)
    rows = stack.up(progress=lambda t: click.echo(t, err=True))
    _print_status(rows)
    if c.cfg.api.tokens:
        # the page needs a sign-in: a token from api.tokens, or the admin token the store wrote
        where = f"dashboard: {stack.api_url}/login (sign in with a token from api.tokens)"
    else:
        where = f"API and dashboard: {stack.api_url}/dashboard"
    click.echo(f"\n{where}   API: {stack.api_url}   engines publish to: {stack.broker.bootstrap}")


@click.command("down")
@pass_ctx
def down(c: CliContext) -> None:
    """Stop the embedded stack (workers, then the store, then the broker)."""
    from sparseety.stack.supervisor import Stack

    stopped = Stack(c.cfg).down(progress=lambda t: click.echo(t, err=True))
    click.echo(f"stopped: {', '.join(stopped) or 'nothing was running'}")


@click.command("status")
@pass_ctx
def status(c: CliContext) -> None:
    """Show what runs; exit 1 when a started part is unhealthy or missing, or an engine does not
    deliver its events."""
    from sparseety.stack.supervisor import Stack

    rows = Stack(c.cfg).status()
    _print_status(rows)
    silent = _print_engines(c, store_up=any(r.name == "store" and r.state == "ready" for r in rows))
    states = {r.state for r in rows}
    broken = "unhealthy" in states or (states - {"stopped"} and "stopped" in states)
    sys.exit(1 if broken or silent else 0)


@click.command("demo")
@click.option(
    "--model",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="A real checkpoint instead of the tiny local model.",
)
@click.option("--engine-args", default="", help="JSON engine arguments (default: the tiny-model demo's).")
@click.option("--sessions", default=4, show_default=True, help="Chat sessions per tenant.")
@click.option("--quick", is_flag=True, help="A short run (what CI does).")
@click.option("--keep-running", is_flag=True, help="Leave the stack up afterwards to explore the API.")
@click.option(
    "--engine",
    type=click.Choice(["vllm", "sglang"]),
    default="vllm",
    show_default=True,
    help="The serving engine (sglang: a real SGLang server from .venv-sglang, docs/sglang.md).",
)
@click.option(
    "--sglang-python",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The Python of SGLang's venv (default: .venv-sglang/bin/python beside this checkout).",
)
@pass_ctx
def demo(
    c: CliContext,
    model: Path | None,
    engine_args: str,
    sessions: int,
    quick: bool,
    keep_running: bool,
    engine: str,
    sglang_python: Path | None,
) -> None:
    """Run the whole pipeline on this machine and print a cost-attribution report.

    Builds the tiny local MoE model if missing, starts the embedded stack, runs vLLM with the
    plugin under a workload that exercises every token status, checks the report against what
    the engine returned, writes an HTML dashboard, and stops the stack. ``--engine sglang`` runs
    the same workload on SGLang (the tiny Llama) and checks against SGLang's own answers.
    """
    from sparseety.stack.demo import run_demo

    result = run_demo(
        c.cfg,
        model=model,
        sessions=sessions,
        quick=quick,
        keep_running=keep_running,
        engine_args=json.loads(engine_args) if engine_args else None,
        engine=engine,
        sglang_python=sglang_python,
        say=_say,
    )
    sys.exit(1 if result.problems else 0)


COMMANDS = [up, down, status, demo]
