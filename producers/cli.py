"""``sparseety proxy`` (the OpenAI-compatible proxy producer) and ``sparseety relay`` (a sidecar
relay, :mod:`.relay`)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from sparseety.cli_context import CliContext, pass_ctx
from sparseety.errors import ConfigError
from sparseety.tenants import check_tenant


def _load_keys(path: str | None) -> dict[str, str]:
    if not path:
        return {}
    text = Path(path).read_text()
    try:
        if path.endswith(".toml"):
            import tomllib

            data = tomllib.loads(text)
            data = data.get("api_keys", data)
        else:
            data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"cannot read API key map {path}: {exc}", path=path) from None
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise ConfigError(f"API key map {path} must map keys to tenant names", path=path)
    for tenant in data.values():
        check_tenant(tenant, where=f"API key map {path}")  # the key itself is never quoted
    return {str(k): v for k, v in data.items()}


@click.command("proxy")
@click.option(
    "--upstream", required=True, help="Base URL of the OpenAI-compatible server, e.g. http://127.0.0.1:8000."
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8001, show_default=True, type=int, help="Port to listen on.")
@click.option(
    "--api-keys",
    "api_keys",
    type=click.Path(exists=True, dir_okay=False),
    help="JSON (or TOML with an [api_keys] table) mapping API keys to tenants.",
)
@click.option(
    "--tenant-header",
    default="X-Sparseety-Tenant",
    show_default=True,
    help="Header naming the tenant; believed only with proxy.trust_tenant_header (a gateway sets it).",
)
@click.option(
    "--engine-name", default="", help="Name of this proxy in the event stream (default <host>-proxy-<port>)."
)
@pass_ctx
def proxy(
    c: CliContext,
    upstream: str,
    host: str,
    port: int,
    api_keys: str | None,
    tenant_header: str,
    engine_name: str,
) -> None:
    """Forward an OpenAI-compatible API and publish request-level usage events.

    For engines without SparSEEty hooks (SGLang, TensorRT-LLM, a vLLM without the plugin):
    responses pass through untouched; each completion becomes a RequestStarted +
    RequestFinished pair with usage, cached tokens and per-chunk arrival times.
    """
    import uvicorn

    from sparseety.kafka import ensure_topics, wait_for_kafka

    from .proxy.app import ProxyProducer, create_app

    cfg = c.cfg
    wait_for_kafka(cfg)
    ensure_topics(cfg, [cfg.topics.engine_events])
    producer = ProxyProducer(
        cfg,
        upstream,
        api_keys=_load_keys(api_keys),
        tenant_header=tenant_header,
        engine_name=engine_name or cfg.engine_name(f"proxy-{port}"),
    )
    uvicorn.run(create_app(producer), host=host, port=port, log_level="info")


@click.command("relay")
@click.option(
    "--socket",
    "socket_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="Unix socket to serve; engines set producer.relay = unix:<this path>.",
)
@pass_ctx
def relay(c: CliContext, socket_path: str) -> None:
    """Encode and produce engines' events beside them (a sidecar relay).

    Each engine stream that connects is relayed with this process's configuration (Kafka,
    schema registry, spill dir). SIGTERM or SIGINT stops accepting, lets every stream
    deliver or journal what it holds, and exits 0.
    """
    import signal
    import threading

    from .relay import serve_socket

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    serve_socket(Path(socket_path), c.cfg, stop)


COMMANDS = [proxy, relay]
