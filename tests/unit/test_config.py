from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from pydantic import ValidationError

from sparseety.config import is_configured, load_config, to_toml
from sparseety.errors import ConfigError


def test_defaults_are_valid_and_frozen() -> None:
    cfg = load_config()
    assert cfg.topics.engine_events == "sparseety.engine-events"
    assert cfg.clickhouse_dsn.startswith("chdb://") and cfg.clickhouse_dsn.endswith("/chdb")
    with pytest.raises(ValidationError):
        cfg.kafka.bootstrap = "x"  # type: ignore[misc]


def test_file_then_environment_precedence(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('data_dir = "/srv/sp"\n[kafka]\nbootstrap = "file:1"\n[topics]\npartitions = 8\n')
    cfg = load_config(env={"SPARSEETY_CONFIG": str(path), "SPARSEETY_KAFKA_BOOTSTRAP": "env:2"})
    assert (cfg.kafka.bootstrap, cfg.topics.partitions, str(cfg.data_dir)) == ("env:2", 8, "/srv/sp")


def test_secrets_never_print() -> None:
    cfg = load_config(
        env={
            "SPARSEETY_KAFKA_CLIENT": '{"sasl.password": "hunter2hunter2", "security.protocol": "SASL_SSL"}',
            "SPARSEETY_PRIVACY_MODE": "hashed",
            "SPARSEETY_PRIVACY_KEY": "k" * 20,
            "SPARSEETY_CLICKHOUSE_PASSWORD": "chsecret",
            "SPARSEETY_API_TOKENS": '{"tok-abc": ["acme"]}',
        }
    )
    text = repr(cfg) + str(cfg)
    for secret in ("hunter2hunter2", "k" * 20, "chsecret", "tok-abc"):
        assert secret not in text
    assert cfg.kafka.librdkafka()["sasl.password"] == "hunter2hunter2"  # still usable


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"SPARSEETY_KAFKA_BOOTSTRAPP": "x"}, "unknown configuration variable SPARSEETY_KAFKA_BOOTSTRAPP"),
        ({"SPARSEETY_TOPICS_PARTITIONS": "0"}, "topics.partitions"),
        ({"SPARSEETY_PRIVACY_MODE": "hashed"}, "needs privacy.key"),
        ({"SPARSEETY_PRIVACY_MODE": "plain"}, "privacy.mode"),
        ({"SPARSEETY_CLICKHOUSE_DSN": "mysql://x"}, "clickhouse.dsn"),
        ({"SPARSEETY_KAFKA_CLIENT": "{not json"}, "must be JSON"),
    ],
)
def test_bad_values_are_clear_config_errors(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env=env)
    assert fragment in str(info.value)


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text("[kafka\n")
    with pytest.raises(ConfigError):
        load_config(tmp_path / "bad.toml")
    with pytest.raises(ConfigError):
        load_config(tmp_path / "missing.toml")


def test_plugin_activation_rule() -> None:
    assert not is_configured({})
    assert is_configured({"SPARSEETY_KAFKA_BOOTSTRAP": "h:1"})
    assert is_configured({"SPARSEETY_CONFIG": "/etc/sparseety.toml"})


def test_topics_resolve_roles_and_full_names() -> None:
    cfg = load_config(topics={"timelines": "t.timelines"})
    assert cfg.topics.resolve("timelines") == "t.timelines"
    assert cfg.topics.resolve("engine-events") == cfg.topics.engine_events
    assert cfg.topics.resolve("some.other.topic") == "some.other.topic"


def test_config_show_is_toml_that_loads_back_to_the_same_config(tmp_path: Path) -> None:
    cfg = load_config(
        data_dir=str(tmp_path),
        kafka={"bootstrap": "k:9092", "client": {"security.protocol": "SASL_SSL"}},
        topics={"partitions": 8},
        worker={"window_s": 30.0},
        api={"port": 9000},
    )
    path = tmp_path / "shown.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path=path, env={}) == cfg


def test_config_show_masks_every_secret() -> None:
    cfg = load_config(
        kafka={"client": {"sasl.password": "hunter2-kafka", "sasl.username": "u"}},
        clickhouse={"password": "hunter2-clickhouse"},
        schema_registry={"basic_auth": "user:hunter2-registry"},
        privacy={"mode": "hashed", "key": "hunter2-privacy-key-0123"},
        otel={"headers": {"authorization": "Bearer hunter2-otel"}},
        api={"tokens": {"hunter2-api-token": ["acme"]}},
    )
    shown = to_toml(cfg)
    assert "hunter2" not in shown
    assert tomllib.loads(shown)["api"]["tokens"] == {"<token 1>": ["acme"]}
    assert tomllib.loads(shown)["kafka"]["client"]["sasl.username"] == "u"


def test_the_session_timeout_follows_the_broker_unless_set(tmp_path: Path) -> None:
    """Unset, a worker's and a sink's group session is Apache Kafka's floor (less would be refused there), and
    2 s on the embedded broker, whose join rounds last half of it; a set value is kept on both."""
    from sparseety.broker import EmbeddedBroker
    from sparseety.config import EMBEDDED_SESSION_TIMEOUT_S, KAFKA_SESSION_TIMEOUT_S

    cfg = load_config(data_dir=str(tmp_path))
    assert (
        cfg.worker.session_timeout_s is None and cfg.worker.session_timeout == KAFKA_SESSION_TIMEOUT_S == 6.0
    )
    assert cfg.sink.session_timeout_s is None and cfg.sink.session_timeout == 6.0
    embedded = EmbeddedBroker(cfg).client_config()
    assert embedded.worker.session_timeout == EMBEDDED_SESSION_TIMEOUT_S == 2.0
    assert embedded.sink.session_timeout == 2.0
    set_ = load_config(data_dir=str(tmp_path), worker={"session_timeout_s": 9.5})
    assert set_.worker.session_timeout == EmbeddedBroker(set_).client_config().worker.session_timeout == 9.5
    # what the stack hands its workers (SPARSEETY_* variables) carries the resolved value
    from sparseety.config import to_env

    assert load_config(env=to_env(embedded)).worker.session_timeout == 2.0
    assert "SPARSEETY_WORKER_SESSION_TIMEOUT_S" not in to_env(cfg)
