"""The one translation of librdkafka's client options (``kafka.client``) for the asyncio clients:
aiokafka's keywords (replay, the refetcher) and Faust's credentials are built from the same
reading, so the worker and the replay reach the cluster the same way."""

from __future__ import annotations

import ssl

import pytest

from sparseety.config import Config, load_config
from sparseety.errors import ConfigError
from sparseety.kafka import aiokafka_settings, client_security
from sparseety.streams.runtime import faust_broker_settings


def _cfg(client: dict[str, str]) -> Config:
    return load_config(kafka={"bootstrap": "k1:9092,k2:9092", "client": client})


def test_plaintext_is_the_bootstrap_alone() -> None:
    cfg = _cfg({})
    assert aiokafka_settings(cfg) == {"bootstrap_servers": "k1:9092,k2:9092"}
    assert faust_broker_settings(cfg) == {"broker": "kafka://k1:9092,kafka://k2:9092"}


def test_sasl_ssl_reaches_both_clients_alike() -> None:
    cfg = _cfg(
        {
            "security.protocol": "sasl_ssl",
            "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.username": "svc",
            "sasl.password": "hunter2hunter2",
        }
    )
    got = aiokafka_settings(cfg)
    assert got["security_protocol"] == "SASL_SSL" and got["sasl_mechanism"] == "SCRAM-SHA-512"
    assert (got["sasl_plain_username"], got["sasl_plain_password"]) == ("svc", "hunter2hunter2")
    assert isinstance(got["ssl_context"], ssl.SSLContext)
    creds = faust_broker_settings(cfg)["broker_credentials"]
    assert creds.protocol.value == got["security_protocol"]
    assert creds.mechanism.value == got["sasl_mechanism"]
    assert (creds.username, creds.password) == ("svc", "hunter2hunter2")


def test_ssl_has_a_context_and_no_sasl() -> None:
    cfg = _cfg({"security.protocol": "SSL"})
    got = aiokafka_settings(cfg)
    assert got["security_protocol"] == "SSL" and "sasl_mechanism" not in got
    assert isinstance(got["ssl_context"], ssl.SSLContext)
    assert faust_broker_settings(cfg)["broker_credentials"].protocol.value == "SSL"


def test_an_unknown_protocol_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"security\.protocol KERBEROS"):
        client_security(_cfg({"security.protocol": "kerberos"}))
