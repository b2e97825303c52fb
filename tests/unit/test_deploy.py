"""deploy/ checked against the code, since neither Docker nor Kubernetes runs here.

Every file under deploy/ is parsed. Then, for the compose stack and the Kubernetes manifests:
commands resolve in the ``sparseety`` click registry with valid options; every ``SPARSEETY_*``
variable is a known setting and the effective configuration of each container (its TOML plus
its environment, secrets replaced by placeholders) validates; topic names, partitions and
replication match the configuration; ports and host names agree between the configuration, the
services and the scrape targets; secrets reach containers only through Secrets. The Grafana
dashboards' SQL runs against a migrated chDB database holding requests recorded from real vLLM,
and every metric the alerts and dashboards use is defined by the code.
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
import tempfile
import tomllib
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import click
import kubernetes_validate
import pytest
import yaml
from prometheus_client import REGISTRY, CollectorRegistry

from sparseety import events as ev
from sparseety.cli import main
from sparseety.config import Config, ProducerConfig, env_overrides, is_configured, load_config
from sparseety.queries.sql import Access, run_sql
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.migrate import migrate
from sparseety.sinks.clickhouse.prices import Price, set_prices
from sparseety.sinks.clickhouse.writer import ClickHouseSink
from sparseety.streams.app import STATE_TABLE
from sparseety.streams.assembler import Assembler
from sparseety.streams.state import MemoryStore
from tests import factories as f
from tests.helpers import chdb_config, throwaway_store
from tests.recorded import load_scenario, scenarios

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose" / "compose.yaml"
K8S = DEPLOY / "k8s"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
SECRET_HINTS = ("PASSWORD", "TOKENS", "_KEY", "BASIC_AUTH", "HEADERS")
PLACEHOLDER = "placeholder-secret-0123456789"


# --- helpers ---------------------------------------------------------------------------------------


def yaml_docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def resolve_command(argv: list[str]) -> click.Context:
    """Parse ``sparseety <argv>`` with the real click registry (validates options; runs nothing)."""
    cmd: click.Command = main
    args = list(argv)
    while isinstance(cmd, click.Group):
        assert args, f"`sparseety {' '.join(argv)}` names no subcommand"
        name = args.pop(0)
        sub = cmd.get_command(click.Context(cmd), name)
        assert sub is not None, f"`sparseety {' '.join(argv)}`: no command {name!r} in the CLI"
        cmd = sub
    return cmd.make_context(" ".join(argv[: len(argv) - len(args)]), args)


def known_variables(env: dict[str, str]) -> None:
    """Every SPARSEETY_* variable names a setting (env_overrides raises otherwise)."""
    env_overrides({k: v for k, v in env.items() if k.startswith("SPARSEETY_") and k != "SPARSEETY_CONFIG"})


def toml_config(text: str, env: dict[str, str]) -> Config:
    """The configuration of a TOML document (a ConfigMap's) under ``env``, as a file would load."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sparseety.toml"
        path.write_text(text)
        return load_config(path, env=env)


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable interpolation: ${X}, ${X:-default}, ${X:?error}, and $$ for a dollar."""

    def sub(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if op == ":-":
            return env.get(name) or arg
        assert name in env, f"compose needs ${{{name}}}, which deploy/compose/.env.example does not set"
        return env[name]

    out = re.sub(r"\$\{([A-Z0-9_]+)(?:(:[-?])([^}]*))?\}", sub, text.replace("$$", "\0"))
    return out.replace("\0", "$")


def interpolated(node: Any, env: dict[str, str]) -> Any:
    """Compose interpolates the strings of the parsed file (a value stays a string)."""
    if isinstance(node, dict):
        return {k: interpolated(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolated(v, env) for v in node]
    return interpolate(node, env) if isinstance(node, str) else node


def dotenv(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


def host_port(url: str) -> tuple[str, int]:
    rest = url.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = rest.rpartition(":")
    return host, int(port)


def metric_names() -> set[str]:
    """Sample names every SparSEEty metric can have (producers, workers, API)."""
    from types import SimpleNamespace

    import sparseety.producers.metrics
    import sparseety.streams.metrics  # noqa: F401  (registers the worker metrics)
    from sparseety.api.metrics import ApiMetrics, SinkCollector
    from sparseety.sinks.base import FlushResult

    sink = CollectorRegistry()
    worker = SimpleNamespace(records=0, dead_letters=0, writes=0, totals=FlushResult(), held={})
    sink.register(SinkCollector(worker))
    names: set[str] = set()
    registries: list[CollectorRegistry] = [REGISTRY, ApiMetrics().registry, sink]
    for registry in registries:
        for family in registry.collect():
            if not family.name.startswith("sparseety:"):
                continue
            suffixes = {
                "counter": ["_total", "_created"],
                "histogram": ["_bucket", "_sum", "_count", "_created"],
                "gauge": [""],
            }.get(family.type, [""])
            names.update(family.name + s for s in suffixes)
    return names


METRIC = re.compile(r"sparseety:[a-z_:]+")


# --- every file parses -----------------------------------------------------------------------------


def test_every_deploy_file_parses() -> None:
    kinds: dict[str, int] = {}
    # Build metadata pip leaves beside deploy/sglang-cpu's shims (git-ignored) is not a deploy file.
    for path in sorted(p for p in DEPLOY.rglob("*") if p.is_file() and ".egg-info" not in str(p)):
        name = path.name
        if name.endswith((".yaml", ".yml")):
            assert yaml_docs(path), path
            kind = "yaml"
        elif name.endswith(".json"):
            json.loads(path.read_text())
            kind = "json"
        elif name.endswith(".toml"):
            tomllib.loads(path.read_text())
            kind = "toml"
        elif name.endswith(".xml"):
            ET.fromstring(path.read_text())
            kind = "xml"
        elif name.startswith("Dockerfile") and not name.endswith(".dockerignore"):
            dockerfile(path)
            kind = "dockerfile"
        elif name.endswith(".py"):  # deploy/sglang-cpu: the CPU shims installed into SGLang's venv
            compile(path.read_text(), str(path), "exec")
            kind = "python"
        elif name in (".env.example", ".gitignore") or name.endswith(".dockerignore"):
            assert path.read_text().strip()
            kind = "text"
        else:
            raise AssertionError(f"{path}: a file type this test does not check")
        kinds[kind] = kinds.get(kind, 0) + 1
    assert kinds["yaml"] >= 15 and kinds["json"] == 4 and kinds["dockerfile"] == 2


# --- Dockerfiles -----------------------------------------------------------------------------------

INSTRUCTIONS = {"FROM", "RUN", "COPY", "ENV", "ARG", "WORKDIR", "USER", "EXPOSE", "ENTRYPOINT", "CMD"}


def dockerfile(path: Path) -> list[tuple[str, str]]:
    """(instruction, arguments) with continuation lines joined; unknown instructions fail."""
    out: list[tuple[str, str]] = []
    current = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        current += " " + line.rstrip("\\").strip() if current else line.rstrip("\\").strip()
        if line.endswith("\\"):
            continue
        word, _, rest = current.partition(" ")
        assert word in INSTRUCTIONS, f"{path.name}: unknown instruction {word}"
        out.append((word, rest.strip()))
        current = ""
    assert not current, f"{path.name}: dangling continuation"
    return out


def dockerfile_env(instructions: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in instructions:
        if word == "ENV":
            for item in shlex.split(rest):
                k, _, v = item.partition("=")
                env[k] = v
    return env


def test_sparseety_image_installs_the_project_and_runs_the_cli() -> None:
    steps = dockerfile(DEPLOY / "docker" / "Dockerfile")
    (entry,) = [json.loads(rest) for word, rest in steps if word == "ENTRYPOINT"]
    assert entry == ["sparseety"]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["sparseety"] == "sparseety.cli:main"
    assert "otel" in pyproject["project"]["optional-dependencies"]
    assert any(w == "RUN" and '".[otel]"' in r for w, r in steps)
    # every package folder the build installs is copied in
    copied = {r.split()[0] for w, r in steps if w == "COPY" and not r.startswith("--from")}
    for src in pyproject["tool"]["setuptools"]["package-dir"].values():
        assert src in copied, f"Dockerfile does not copy {src}/"
    assert {"pyproject.toml", "README.md"} <= {p for w, r in steps if w == "COPY" for p in r.split()[:-1]}
    for p in copied:
        assert (ROOT / p).exists(), p
    env = dockerfile_env(steps)
    known_variables(env)
    cfg = load_config(env=env)
    assert str(cfg.data_dir) == "/var/lib/sparseety"
    (expose,) = [r.split() for w, r in steps if w == "EXPOSE"]
    deploy_cfg = load_config(DEPLOY / "config" / "sparseety.toml")
    assert {int(p) for p in expose} == {deploy_cfg.api.port, deploy_cfg.worker.metrics_port}
    # the .dockerignore beside it lets every copied path through
    ignore = (DEPLOY / "docker" / "Dockerfile.dockerignore").read_text().split()
    for p in copied:
        assert f"!{p}" in ignore or f"!{p}/**" in ignore, f"{p} is excluded from the build context"


def test_vllm_image_layers_the_plugin_over_vllm() -> None:
    steps = dockerfile(DEPLOY / "docker" / "Dockerfile.vllm")
    (base,) = [r for w, r in steps if w == "FROM"]
    args = dict(r.split("=", 1) for w, r in steps if w == "ARG")
    assert base == "${VLLM_IMAGE}" and args["VLLM_IMAGE"].startswith("vllm/vllm-openai:")
    install = next(r for w, r in steps if w == "RUN" and "pip install" in r)
    assert "/tmp/sparseety" in install and "[vllm]" not in install  # no second vLLM/torch
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    plugin = pyproject["project"]["entry-points"]["vllm.general_plugins"]["sparseety"]
    assert plugin == "sparseety.producers.vllm.plugin:register"
    assert "vllm.general_plugins" in install
    assert dockerfile_env(steps)["PROMETHEUS_MULTIPROC_DIR"]


# --- configuration files ---------------------------------------------------------------------------


def compose_env() -> dict[str, str]:
    return dotenv(DEPLOY / "compose" / ".env.example")


def test_sample_configuration_is_valid_and_holds_no_secret() -> None:
    text = (DEPLOY / "config" / "sparseety.toml").read_text()
    cfg = load_config(DEPLOY / "config" / "sparseety.toml")
    assert cfg.clickhouse.password is None and cfg.api.tokens == {} and cfg.privacy.key is None
    assert not re.search(r"(?i)^\s*(password|key|tokens|basic_auth)\s*=", text, re.M)
    assert cfg.worker.metrics_port > 0 and cfg.topics.partitions >= 2


# --- compose ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = interpolated(yaml.safe_load(COMPOSE.read_text()), compose_env())
    assert isinstance(doc, dict)
    return doc


def service_env(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def mounted_file(svc: dict[str, Any], target: str) -> Path:
    for v in svc.get("volumes", []):
        src, _, rest = v.partition(":")
        if rest.split(":")[0] == target:
            return (COMPOSE.parent / src).resolve()
    raise AssertionError(f"{target} is not mounted")


def effective_config(svc: dict[str, Any]) -> Config:
    env = service_env(svc)
    known_variables(env)
    path = mounted_file(svc, env["SPARSEETY_CONFIG"])
    return load_config(path, env=env)


def sparseety_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: svc
        for name, svc in compose["services"].items()
        if svc.get("build", {}).get("dockerfile") == "deploy/docker/Dockerfile"
    }


def test_compose_references_exist(compose: dict[str, Any]) -> None:
    services = compose["services"]
    volumes = set(compose.get("volumes") or {})
    secrets = set(compose.get("secrets") or {})
    for name, svc in services.items():
        assert "image" in svc, name
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown service {dep}"
        for v in svc.get("volumes", []):
            src = v.split(":")[0]
            if src.startswith("."):
                assert (COMPOSE.parent / src).exists(), f"{name} mounts missing {src}"
            else:
                assert src in volumes, f"{name} uses undeclared volume {src}"
        for s in svc.get("secrets", []):
            assert s in secrets, f"{name} uses undeclared secret {s}"
        if "build" in svc:
            assert (COMPOSE.parent / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
    for spec in (compose.get("secrets") or {}).values():
        assert spec["environment"] in compose_env()


def test_compose_sparseety_services_run_real_commands_with_valid_configuration(
    compose: dict[str, Any],
) -> None:
    services = sparseety_services(compose)
    assert {"migrate", "worker", "sink", "api", "otel-sink"} <= set(services)
    commands = {}
    for name, svc in services.items():
        ctx = resolve_command(svc["command"])
        commands[name] = (ctx.info_name, ctx.params)
        cfg = effective_config(svc)
        assert str(cfg.data_dir) == "/var/lib/sparseety", name
    assert commands["worker"][0] == "worker" and commands["migrate"][0] == "db migrate"
    assert commands["sink"][1]["sink_names"] == ("clickhouse",)
    assert commands["otel-sink"][1]["sink_names"] == ("otel",)
    assert commands["api"][0] == "api"
    # components that write or query ClickHouse get its password; nothing else gets secrets
    for name in ("migrate", "sink", "api"):
        assert effective_config(services[name]).clickhouse.password is not None, name
    assert effective_config(services["worker"]).clickhouse.password is None
    # the API listens off loopback only with tokens, and one of them sees everything for /metrics
    api = effective_config(services["api"])
    assert api.api.host == "0.0.0.0" and api.api.tokens
    assert api.api.tokens[compose_env()["SPARSEETY_METRICS_TOKEN"]] == ["*"]
    assert f"{api.api.port}:{api.api.port}" in services["api"]["ports"]
    # the OpenTelemetry sink has its own consumer group
    otel = effective_config(services["otel-sink"])
    assert otel.sink.group_id != effective_config(services["sink"]).sink.group_id


def test_compose_endpoints_point_at_the_services(compose: dict[str, Any]) -> None:
    services = compose["services"]
    cfg = effective_config(services["sink"])
    host, port = host_port(cfg.kafka.bootstrap)
    kafka = service_env(services["kafka"])
    assert host == "kafka" and f"PLAINTEXT://kafka:{port}" in kafka["KAFKA_ADVERTISED_LISTENERS"]
    assert int(kafka["KAFKA_NUM_PARTITIONS"]) == cfg.topics.partitions
    host, port = host_port(cfg.schema_registry.url)
    assert host == "schema-registry"
    assert service_env(services[host])["SCHEMA_REGISTRY_LISTENERS"].endswith(f":{port}")
    host, port = host_port(cfg.clickhouse_dsn)
    ch = service_env(services[host])
    assert (host, port) == ("clickhouse", 8123)
    assert (ch["CLICKHOUSE_DB"], ch["CLICKHOUSE_USER"]) == (cfg.clickhouse.database, cfg.clickhouse.username)
    host, port = host_port(cfg.otel.endpoint)
    collector = yaml.safe_load((DEPLOY / "compose" / "otel-collector.yaml").read_text())
    assert host == "otel-collector" and host in services
    http = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    assert cfg.otel.protocol == "http/protobuf" and http.endswith(f":{port}")
    assert "otlp" in collector["service"]["pipelines"]["traces"]["receivers"]


def faust_topics(cfg: Config, groups: list[str]) -> dict[str, int]:
    """Topics the workers need beyond the four data topics: changelog and leader topics."""
    out = {f"{cfg.worker.app_id}-{STATE_TABLE}-changelog": cfg.topics.partitions}
    out.update({f"{g}-__assignor-__leader": 1 for g in groups})
    return out


def test_compose_creates_every_topic_as_configured(compose: dict[str, Any]) -> None:
    services = compose["services"]
    cfg = effective_config(services["worker"])
    script = services["topics-init"]["command"][0]
    created: dict[str, tuple[int, int, str]] = {}
    for m in re.finditer(r"--topic ([^\s$]\S*) --partitions (\d+) --replication-factor (\d+)(.*)", script):
        created[m.group(1)] = (int(m.group(2)), int(m.group(3)), m.group(4))
    loop = re.search(r"for group in ([^;]+); do\s+\$t --topic \$group(\S+) --partitions (\d+)", script)
    assert loop is not None
    for group in loop.group(1).split():
        created[group + loop.group(2)] = (int(loop.group(3)), 1, "")
    groups = [
        cfg.worker.app_id,
        effective_config(services["sink"]).sink.group_id,
        effective_config(services["otel-sink"]).sink.group_id,
    ]
    want = {t: cfg.topics.partitions for t in cfg.topics.all()} | faust_topics(cfg, groups)
    assert {t: p for t, (p, _, _) in created.items()} == want
    assert all(r == cfg.topics.replication_factor for _, r, _ in created.values())
    changelog = f"{cfg.worker.app_id}-{STATE_TABLE}-changelog"
    assert "cleanup.policy=compact" in created[changelog][2]
    assert "retention.ms=" in created[cfg.topics.engine_events][2]
    assert service_env(services["kafka"])["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"


def test_compose_workers_scale_within_partitions_and_are_scraped(compose: dict[str, Any]) -> None:
    services = compose["services"]
    cfg = effective_config(services["worker"])
    replicas = services["worker"]["deploy"]["replicas"]
    assert 2 <= replicas <= cfg.topics.partitions
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    (sd,) = jobs["sparseety-worker"]["dns_sd_configs"]
    assert sd["names"] == ["worker"] and sd["port"] == cfg.worker.metrics_port
    api = effective_config(services["api"])
    assert jobs["sparseety-api"]["static_configs"][0]["targets"] == [f"api:{api.api.port}"]
    secret = jobs["sparseety-api"]["authorization"]["credentials_file"]
    assert secret == "/run/secrets/" + services["prometheus"]["secrets"][0]
    vllm_port = next(a for a in services["vllm"]["command"] if a.startswith("--port=")).split("=")[1]
    assert jobs["vllm"]["static_configs"][0]["targets"] == [f"vllm:{vllm_port}"]
    for job in ("kafka-exporter",):
        host, _, _ = jobs[job]["static_configs"][0]["targets"][0].partition(":")
        assert host in services
    mounts = {v.split(":")[1] for v in services["prometheus"]["volumes"]}
    assert set(prom["rule_files"]) <= mounts


def check_vllm(args: list[str], env: dict[str, str], cfg: Config) -> None:
    """The engine runs with prefix caching and KV events, and the plugin is switched on."""
    assert "--enable-prefix-caching" in args
    kv = next(a for a in args if a.startswith("--kv-events-config="))
    kv_cfg = json.loads(kv.split("=", 1)[1])
    assert kv_cfg["enable_kv_cache_events"] is True and kv_cfg["publisher"] in ("null", "zmq")
    assert is_configured(env), "neither SPARSEETY_CONFIG nor SPARSEETY_KAFKA_BOOTSTRAP: plugin stays off"
    opts = dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)
    assert int(opts["--shutdown-timeout"]) >= 5  # else the engine core is killed before it flushes
    module, _, cls = opts["--middleware"].rpartition(".")
    assert getattr(importlib.import_module(module), cls)
    assert cfg.privacy.mode == "hashed" and cfg.privacy.key is not None
    assert env["PROMETHEUS_MULTIPROC_DIR"]


def test_compose_vllm_enables_the_plugin(compose: dict[str, Any]) -> None:
    svc = compose["services"]["vllm"]
    assert svc["entrypoint"] == ["vllm", "serve"]
    assert svc["build"]["dockerfile"] == "deploy/docker/Dockerfile.vllm"
    env = service_env(svc)
    cfg = effective_config(svc)
    check_vllm(svc["command"], env, cfg)
    assert env["PROMETHEUS_MULTIPROC_DIR"] in svc["tmpfs"]  # starts empty on every start
    assert cfg.spill_path == Path("/var/lib/sparseety/spill")
    assert any(v.endswith(":" + str(cfg.spill_path)) for v in svc["volumes"])


def test_compose_grafana_provisions_clickhouse_and_the_dashboards(compose: dict[str, Any]) -> None:
    svc = compose["services"]["grafana"]
    env = service_env(svc)
    assert "grafana-clickhouse-datasource" in env["GF_PLUGINS_PREINSTALL_SYNC"]
    prov = DEPLOY / "grafana" / "provisioning"
    (provider,) = yaml.safe_load((prov / "dashboards" / "sparseety.yaml").read_text())["providers"]
    assert f"../grafana/dashboards:{provider['options']['path']}:ro" in svc["volumes"]
    assert "../grafana/provisioning:/etc/grafana/provisioning:ro" in svc["volumes"]
    sources = yaml.safe_load((prov / "datasources" / "sparseety.yaml").read_text())["datasources"]
    ch = next(s for s in sources if s["type"] == "grafana-clickhouse-datasource")
    var = re.fullmatch(r"\$\{(\w+)\}", ch["secureJsonData"]["password"])
    assert var and var.group(1) in env
    assert ch["jsonData"]["host"] == "clickhouse" and ch["jsonData"]["protocol"] == "http"
    assert (
        ch["jsonData"]["port"] == host_port(effective_config(compose["services"]["sink"]).clickhouse_dsn)[1]
    )
    # the read-only user Grafana logs in as, with its password from the same variable
    users = ET.fromstring((DEPLOY / "compose" / "clickhouse" / "users.d" / "grafana.xml").read_text())
    user = users.find(f"users/{ch['jsonData']['username']}")
    assert user is not None and user.find("password").get("from_env") == var.group(1)  # type: ignore[union-attr]
    assert var.group(1) in service_env(compose["services"]["clickhouse"])


# --- Kubernetes ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k8s() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = set(kustomization["resources"])
    assert files == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    docs = [d for name in kustomization["resources"] for d in yaml_docs(K8S / name)]
    assert all({"apiVersion", "kind", "metadata"} <= set(d) for d in docs)
    return docs


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    return found


def k8s_config(docs: list[dict[str, Any]], env: dict[str, str] | None = None) -> Config:
    text = named(docs, "ConfigMap", "sparseety-config")["data"]["sparseety.toml"]
    return toml_config(text, env or {})


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def container_env(container: dict[str, Any]) -> tuple[dict[str, str], set[str]]:
    """The container's environment with secrets replaced by placeholders and $(VAR) expanded,
    and the names of the variables that came from Secrets."""
    env: dict[str, str] = {}
    from_secrets: set[str] = set()
    for item in container.get("env", []):
        name = item["name"]
        if "valueFrom" in item:
            source = item["valueFrom"]
            if "secretKeyRef" in source:
                from_secrets.add(name)
                env[name] = json.dumps({PLACEHOLDER: ["*"]}) if name.endswith("TOKENS") else PLACEHOLDER
            else:
                env[name] = "pod-value"
            continue
        value = str(item["value"])
        refs = re.findall(r"\$\((\w+)\)", value)
        for ref in refs:
            assert ref in env, f"{name} refers to $({ref}) before it is defined"
        env[name] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], value)
        if refs and all(r in from_secrets for r in refs):
            from_secrets.add(name)
    return env, from_secrets


def workloads(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for d in docs:
        if d["kind"] in ("Deployment", "Job", "StatefulSet"):
            for c in pod_spec(d)["containers"]:
                yield d, c


def test_k8s_core_resources_match_the_kubernetes_schema(k8s: list[dict[str, Any]]) -> None:
    core = [d for d in k8s if "." not in d["apiVersion"].split("/")[0] or d["apiVersion"] == "v1"]
    assert {d["kind"] for d in core} >= {"Namespace", "ConfigMap", "Deployment", "Service", "Job"}
    for d in core:
        kubernetes_validate.validate(d, kubernetes_validate.latest_version(), strict=True)
    assert not of_kind(k8s, "Secret"), "secrets are created outside the manifests, never inline"


def test_k8s_secrets_reach_containers_only_through_secret_refs(k8s: list[dict[str, Any]]) -> None:
    checked = 0
    for doc, c in workloads(k8s):
        _, from_secrets = container_env(c)
        for item in c.get("env", []):
            name = item["name"]
            secretish = any(h in name for h in SECRET_HINTS) or (
                name == "SPARSEETY_KAFKA_CLIENT" and "password" in str(item.get("value", ""))
            )
            if secretish:
                assert name in from_secrets, f"{doc['metadata']['name']}: {name} is not from a Secret"
                checked += 1
    assert checked >= 10


def test_k8s_sparseety_containers_run_real_commands_with_valid_configuration(
    k8s: list[dict[str, Any]],
) -> None:
    seen = {}
    for doc, c in workloads(k8s):
        if c["image"] != "sparseety":
            continue
        ctx = resolve_command(c["args"])
        env, _ = container_env(c)
        known_variables(env)
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod_spec(doc)["volumes"]}
        config_dir = str(Path(env["SPARSEETY_CONFIG"]).parent)
        assert volumes[mounts[config_dir]]["configMap"]["name"] == "sparseety-config"
        cfg = k8s_config(k8s, env)
        assert str(cfg.data_dir) in mounts  # writable data dir
        if cfg.kafka.client.get("ssl.ca.location") and ctx.info_name != "db migrate":
            ca_dir = str(Path(cfg.kafka.client["ssl.ca.location"]).parent)
            assert volumes[mounts[ca_dir]]["secret"]["secretName"] == "sparseety-kafka-cluster-ca-cert"
            assert cfg.kafka.client["sasl.password"] == PLACEHOLDER
        seen[doc["metadata"]["name"]] = (ctx.info_name, cfg)
    assert seen["sparseety-worker"][0] == "worker" and seen["sparseety-api"][0] == "api"
    assert seen["sparseety-sink"][0] == "sink" and seen["sparseety-db-migrate"][0] == "db migrate"
    assert seen["sparseety-otel-sink"][0] == "sink"
    assert seen["sparseety-otel-sink"][1].clickhouse.password is None  # it never touches ClickHouse
    for name, sinks in (("sparseety-sink", ("clickhouse",)), ("sparseety-otel-sink", ("otel",))):
        (c,) = pod_spec(named(k8s, "Deployment", name))["containers"]
        assert resolve_command(c["args"]).params["sink_names"] == sinks
    for name in ("sparseety-sink", "sparseety-api", "sparseety-db-migrate"):
        assert seen[name][1].clickhouse.password is not None
    api = seen["sparseety-api"][1]
    assert api.api.host == "0.0.0.0" and api.api.tokens


def test_k8s_topics_users_and_kafka_match_the_configuration(k8s: list[dict[str, Any]]) -> None:
    cfg = k8s_config(k8s)
    (kafka,) = of_kind(k8s, "Kafka")
    cluster = kafka["metadata"]["name"]
    topics = {
        t["spec"]["topicName"]: t
        for t in of_kind(k8s, "KafkaTopic")
        if t["metadata"]["labels"]["strimzi.io/cluster"] == cluster
    }
    groups = [cfg.worker.app_id]
    for _, c in workloads(k8s):
        if c["image"] == "sparseety" and c["args"][0] == "sink":
            groups.append(k8s_config(k8s, container_env(c)[0]).sink.group_id)
    assert len(set(groups)) == len(groups) == 3  # assembler, ClickHouse sink, OpenTelemetry sink
    want = {t: cfg.topics.partitions for t in cfg.topics.all()} | faust_topics(cfg, groups)
    assert {name: t["spec"]["partitions"] for name, t in topics.items()} == want
    assert all(t["spec"]["replicas"] == cfg.topics.replication_factor for t in topics.values())
    changelog = f"{cfg.worker.app_id}-{STATE_TABLE}-changelog"
    assert topics[changelog]["spec"]["config"]["cleanup.policy"] == "compact"
    assert topics[cfg.topics.engine_events]["spec"]["config"]["retention.ms"] >= 86_400_000
    # the configured bootstrap is the cluster's bootstrap service on the SASL/TLS listener
    host, port = host_port(cfg.kafka.bootstrap)
    assert host.split(".")[0] == f"{cluster}-kafka-bootstrap"
    (listener,) = [x for x in kafka["spec"]["kafka"]["listeners"] if x["port"] == port]
    assert listener["tls"] and cfg.kafka.client["security.protocol"] == "SASL_SSL"
    assert listener["authentication"]["type"] == cfg.kafka.client["sasl.mechanism"].lower()
    assert kafka["spec"]["kafka"]["config"]["auto.create.topics.enable"] is False
    # users: the configured one and the engines' one exist, and pods read their own password
    users = {u["metadata"]["name"]: u for u in of_kind(k8s, "KafkaUser")}
    assert cfg.kafka.client["sasl.username"] in users
    for doc, c in workloads(k8s):
        env, _ = container_env(c)
        if "SPARSEETY_KAFKA_CLIENT" not in env:
            continue
        username = (
            json.loads(env["SPARSEETY_KAFKA_CLIENT"]).get("sasl.username")
            or cfg.kafka.client["sasl.username"]
        )
        (ref,) = [i for i in c["env"] if i["name"] == "KAFKA_PASSWORD"]
        assert ref["valueFrom"]["secretKeyRef"] == {"name": username, "key": "password"}
        assert username in users
        if doc["metadata"]["name"] == "vllm":
            acls = users[username]["spec"]["authorization"]["acls"]
            assert {a["resource"].get("name") for a in acls if a["resource"]["type"] == "topic"} == {
                cfg.topics.engine_events
            }


def test_k8s_workers_clickhouse_registry_and_api_agree_with_the_configuration(
    k8s: list[dict[str, Any]],
) -> None:
    cfg = k8s_config(k8s)
    worker = named(k8s, "Deployment", "sparseety-worker")
    assert 1 <= worker["spec"]["replicas"] <= cfg.topics.partitions
    (c,) = pod_spec(worker)["containers"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"] == cfg.worker.metrics_port
    api = named(k8s, "Deployment", "sparseety-api")
    (c,) = pod_spec(api)["containers"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["http"] == cfg.api.port
    svc = named(k8s, "Service", "sparseety-api")
    assert svc["spec"]["ports"][0]["port"] == cfg.api.port
    assert svc["spec"]["selector"].items() <= api["spec"]["template"]["metadata"]["labels"].items()
    # ClickHouse: the DSN is the installation's service, the cluster is its cluster
    (chi,) = of_kind(k8s, "ClickHouseInstallation")
    (chk,) = of_kind(k8s, "ClickHouseKeeperInstallation")
    host, port = host_port(cfg.clickhouse_dsn)
    assert host.split(".")[0] == f"clickhouse-{chi['metadata']['name']}" and port == 8123
    clusters = [x["name"] for x in chi["spec"]["configuration"]["clusters"]]
    assert cfg.clickhouse.cluster in clusters
    users = chi["spec"]["configuration"]["users"]
    assert users[f"{cfg.clickhouse.username}/k8s_secret_password"] == "sparseety-clickhouse/password"
    assert not any(k.endswith(("/password", "/password_sha256_hex")) for k in users)
    assert (
        chi["spec"]["configuration"]["zookeeper"]["nodes"][0]["host"] == f"keeper-{chk['metadata']['name']}"
    )
    # the schema registry URL is its Service
    host, port = host_port(cfg.schema_registry.url)
    reg = named(k8s, "Service", host.split(".")[0])
    assert reg["spec"]["ports"][0]["port"] == port


def test_k8s_vllm_enables_the_plugin(k8s: list[dict[str, Any]]) -> None:
    doc = named(k8s, "Deployment", "vllm")
    engine, relay = pod_spec(doc)["containers"]
    assert engine["image"] == "vllm-sparseety" and engine["command"] == ["vllm", "serve"]
    env, _ = container_env(engine)
    known_variables(env)
    cfg = k8s_config(k8s, env)
    check_vllm(engine["args"], env, cfg)
    # the engine hands its events to the relay sidecar's socket, on a volume both mount
    assert cfg.producer.relay.startswith("unix:")
    socket_dir = str(Path(cfg.producer.relay.removeprefix("unix:")).parent)
    engine_mounts = {m["mountPath"]: m["name"] for m in engine["volumeMounts"]}
    relay_mounts = {m["mountPath"]: m["name"] for m in relay["volumeMounts"]}
    assert engine_mounts[socket_dir] == relay_mounts[socket_dir]
    assert "KAFKA_PASSWORD" not in env  # the engine never talks to Kafka; the relay does
    ctx = resolve_command(relay["args"])
    assert ctx.info_name == "relay" and ctx.params["socket_path"] == cfg.producer.relay.removeprefix("unix:")
    relay_env, _ = container_env(relay)
    relay_cfg = k8s_config(k8s, relay_env)
    assert relay_cfg.producer.relay == "process"  # its own setting is irrelevant; it spills here:
    assert (
        str(relay_cfg.spill_path).startswith(str(relay_cfg.data_dir))
        and str(relay_cfg.data_dir) in relay_mounts
    )
    # both processes' producer metrics reach vLLM's /metrics through one multiprocess dir
    assert (
        engine_mounts[env["PROMETHEUS_MULTIPROC_DIR"]] == relay_mounts[relay_env["PROMETHEUS_MULTIPROC_DIR"]]
    )
    images = {i["name"] for i in yaml.safe_load((K8S / "kustomization.yaml").read_text())["images"]}
    assert {"sparseety", "vllm-sparseety"} <= images


def test_k8s_monitors_select_the_pods_and_rules_equal_the_compose_rules(k8s: list[dict[str, Any]]) -> None:
    pods = {d["metadata"]["name"]: d for d in k8s if d["kind"] == "Deployment"}
    for pm in of_kind(k8s, "PodMonitor"):
        selector = pm["spec"]["selector"]["matchLabels"]
        if selector.get("strimzi.io/name"):
            (kafka,) = of_kind(k8s, "Kafka")
            assert selector["strimzi.io/name"] == f"{kafka['metadata']['name']}-kafka-exporter"
            continue
        matches = [
            d
            for d in pods.values()
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert matches, f"PodMonitor {pm['metadata']['name']} selects no Deployment"
        for d in matches:
            ports = {p["name"] for c in pod_spec(d)["containers"] for p in c.get("ports", [])}
            for ep in pm["spec"]["podMetricsEndpoints"]:
                assert ep["port"] in ports
    (rule,) = of_kind(k8s, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())


# --- alerts and metrics ----------------------------------------------------------------------------


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_alerts_are_documented_and_use_metrics_the_code_defines() -> None:
    names = metric_names()
    ops = (ROOT / "docs" / "operations.md").read_text()
    assert re.search(r"^## Alerts", ops, re.M)
    rules = alert_rules()
    assert len(rules) >= 10
    for r in rules:
        assert r["labels"]["severity"] in ("critical", "warning", "info")
        assert r["annotations"]["summary"] and r["annotations"]["description"]
        assert r["annotations"]["runbook"] == "docs/operations.md#alerts"
        assert f"`{r['alert']}`" in ops, f"{r['alert']} is not explained in docs/operations.md"
        expr = r["expr"]
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")
        for metric in METRIC.findall(expr):
            assert metric in names, f"{r['alert']}: {metric} is not a metric of the code"
    thresholds = {
        r["alert"]: float(r["expr"].rsplit(">", 1)[1])
        for r in rules
        if "producer_" in r["expr"] and "bytes" in r["expr"]
    }
    p = ProducerConfig()
    assert thresholds["SparseetyProducerSpillNearlyFull"] == int(0.8 * p.spill_max_bytes)
    assert thresholds["SparseetyProducerMemoryHigh"] == int(0.9 * p.memory_limit_bytes)


def test_worker_gauges_the_alerts_need_exist() -> None:
    names = metric_names()
    for needed in (
        "sparseety:worker_lag_events",
        "sparseety:worker_last_event_timestamp_seconds",
        "sparseety:worker_events_total",
        "sparseety:worker_outputs_total",
        "sparseety:dead_letters_total",
        "sparseety:producer_events_total",
        "sparseety:producer_journal_bytes",
        "sparseety:freshness_seconds",
    ):
        assert needed in names


# --- Grafana dashboards ----------------------------------------------------------------------------


def dashboards() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, json.loads(p.read_text())) for p in DASHBOARDS]


def targets(board: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for panel in board["panels"]:
        for t in panel["targets"]:
            yield panel, t


def test_dashboards_are_well_formed_and_use_the_provisioned_sources() -> None:
    sources = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "sparseety.yaml").read_text()
    )
    uids = {s["uid"]: s["type"] for s in sources["datasources"]}
    names = metric_names()
    seen_uids = set()
    for name, board in dashboards():
        assert board["uid"] not in seen_uids, name
        seen_uids.add(board["uid"])
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids))
        db = next(v for v in board["templating"]["list"] if v["name"] == "db")
        assert db["type"] == "constant" and db["query"] == Config().clickhouse.database
        for panel, t in targets(board):
            ds = t["datasource"]
            assert uids[ds["uid"]] == ds["type"] == panel["datasource"]["type"], (name, panel["title"])
            if ds["type"] == "grafana-clickhouse-datasource":
                assert t["editorType"] == "sql" and t["rawSql"].lstrip().upper().startswith("SELECT")
                assert (t["queryType"], t["format"]) in (("table", 1), ("timeSeries", 0))
                if t["queryType"] == "timeSeries":
                    assert "AS time" in t["rawSql"] and panel["type"] == "timeseries"
            else:
                for metric in METRIC.findall(t["expr"]):
                    assert metric in names, f"{name} / {panel['title']}: unknown metric {metric}"
    assert {b["uid"] for _, b in dashboards()} == {
        "sparseety-cost",
        "sparseety-efficiency",
        "sparseety-experts",
        "sparseety-pipeline",
    }


def substitute(sql: str, db: str, t0: int, t1: int, choice: dict[str, list[str]]) -> str:
    """What the grafana-clickhouse-datasource plugin and Grafana do to a query before it runs."""
    sql = re.sub(
        r"\$__timeFilter\(([^()]+)\)",
        lambda m: f"{m.group(1)} >= toDateTime({t0}) AND {m.group(1)} <= toDateTime({t1})",
        sql,
    )
    sql = re.sub(
        r"\$__timeInterval\(([^()]+)\)",
        lambda m: f"toStartOfInterval(toDateTime({m.group(1)}), INTERVAL 60 second)",
        sql,
    )
    sql = sql.replace("$__fromTime", f"toDateTime({t0})").replace("$__toTime", f"toDateTime({t1})")
    sql = sql.replace("$__interval_s", "60").replace("${db}", db)
    for var, values in choice.items():
        sql = sql.replace(f"${{{var}:singlequote}}", ", ".join(f"'{v}'" for v in values))
    assert "$" not in sql, f"unsubstituted macro or variable in: {sql}"
    return sql


@pytest.fixture(scope="module")
def recorded_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Store, list[dict[str, Any]]]]:
    """A migrated database holding every recorded real-vLLM request (plus usage, dead letters, prices)."""
    with throwaway_store(chdb_config(tmp_path_factory, f"d{uuid.uuid4().hex[:10]}")) as store:
        migrate(store)
        records: list[dict[str, Any]] = []
        for name in scenarios():
            events, _ = load_scenario(name)
            asm = Assembler(load_config().worker, MemoryStore())
            records += [
                o.record for e in events for o in asm.apply(e) if o.record_name == ev.REQUEST_ACCOUNTING
            ]
        sink = ClickHouseSink(store)
        for i, rec in enumerate(records):
            sink.add(ev.REQUEST_ACCOUNTING, rec, topic="timelines", partition=0, offset=i)
        t_mid = records[0]["finished_ts_ns"]
        sink.add(ev.USAGE_WINDOW, f.usage_window(window_start_ns=t_mid), topic="usage", partition=0, offset=0)
        sink.add(ev.DEAD_LETTER, f.dead_letter(ts_ns=t_mid), topic="dlq", partition=0, offset=0)
        sink.flush()
        prices = []
        for model in {r["model"] for r in records}:
            prices += [
                Price(model, "input", Decimal("0.2"), 0),
                Price(model, "cached_input", Decimal("0.05"), 0),
                Price(model, "output", Decimal("0.8"), 0),
                Price(model, "gpu_hour", Decimal("2.5"), 0),
            ]
        set_prices(store, prices)
        yield store, records


def test_every_dashboard_query_runs_on_the_migrated_schema_with_recorded_requests(
    recorded_store: tuple[Store, list[dict[str, Any]]],
) -> None:
    store, records = recorded_store
    t0 = min(r["finished_ts_ns"] for r in records) // 10**9 - 3600
    t1 = max(r["finished_ts_ns"] for r in records) // 10**9 + 3600
    tenants = sorted({r["tenant"] for r in records})
    models = sorted({r["model"] for r in records})
    every = {"tenant": ["__all"], "model": ["__all"]}
    picked = {"tenant": [t for t in tenants if t][:1], "model": models[:1]}
    assert picked["tenant"], "the recordings have tenants"
    empty = []
    ran = 0
    readers = store.readers(1)
    reader = readers.store()

    def both(sql: str) -> list[dict[str, Any]]:
        """The rows of ``sql`` as the store answers it, and the same through the SQL allow-list
        (what Grafana gets through ``/clickhouse`` with an all-tenant token)."""
        rows = store.query(sql)
        _, allowed = run_sql(reader, sql, access=Access(None, token_ids=False))
        assert len(allowed) == len(rows), sql
        return rows

    for name, board in dashboards():
        for var in board["templating"]["list"]:
            if var["type"] == "query":
                rows = both(substitute(var["query"], store.database, t0, t1, every))
                assert {r[var["name"]] for r in rows} == set(tenants if var["name"] == "tenant" else models)
        for panel, t in targets(board):
            if t["datasource"]["type"] != "grafana-clickhouse-datasource":
                continue
            for choice in (every, picked):
                rows = both(substitute(t["rawSql"], store.database, t0, t1, choice))
                ran += 1
                if choice is every and not rows:
                    empty.append(f"{name} / {panel['title']}")
    readers.close()
    assert ran >= 60
    assert not empty, f"panels without rows over the recorded requests: {empty}"


def test_dashboard_answers_agree_with_the_recorded_requests(
    recorded_store: tuple[Store, list[dict[str, Any]]],
) -> None:
    store, records = recorded_store
    t0 = min(r["finished_ts_ns"] for r in records) // 10**9 - 3600
    t1 = max(r["finished_ts_ns"] for r in records) // 10**9 + 3600
    every = {"tenant": ["__all"], "model": ["__all"]}
    panels = {(b["uid"], p["title"]): t for _, b in dashboards() for p, t in targets(b)}

    def run(uid: str, title: str, choice: dict[str, list[str]] = every) -> list[dict[str, Any]]:
        return store.query(substitute(panels[(uid, title)]["rawSql"], store.database, t0, t1, choice))

    (row,) = run("sparseety-cost", "Requests")
    assert row["requests"] == len(records)
    table = run("sparseety-cost", "Cost by tenant and model, every attribution mode")
    assert sum(r["requests"] for r in table) == len(records)
    assert sum(r["cache_read_tokens"] for r in table) == sum(r["cache_read_tokens"] for r in records)
    # amortized attribution moves cost between requests, never creates or destroys it
    assert sum(r["amortized_usd"] for r in table) == pytest.approx(sum(r["actual_usd"] for r in table))
    assert all(r["unpriced"] == 0 and r["actual_usd"] > 0 for r in table)
    acme = run("sparseety-cost", "Requests", {"tenant": ["tenant-0"], "model": ["__all"]})
    assert acme[0]["requests"] == sum(r["tenant"] == "tenant-0" for r in records) > 0
    spec = run("sparseety-efficiency", "Speculative decoding by model")
    assert sum(r["accepted"] for r in spec) == sum(r["draft_accepted_tokens"] for r in records) > 0
    experts = run("sparseety-experts", "Expert load: share of each layer's tokens")
    by_layer: dict[tuple[str, int], float] = {}
    for r in experts:
        by_layer[(r["model"], r["layer"])] = by_layer.get((r["model"], r["layer"]), 0) + r["layer_share"]
    assert by_layer and all(s == pytest.approx(1.0) for s in by_layer.values())
    routed = [r for r in records if r["expert_num_layers"]]
    assert sum(r["tokens"] for r in experts) == sum(sum(r["expert_counts"]) for r in routed)
    engines = run("sparseety-pipeline", "Engines")
    assert {r["engine_name"] for r in engines} == {r["engine_name"] for r in records}
    (dead,) = run("sparseety-pipeline", "Dead letters")
    assert dead["dead_letters"] == 1
