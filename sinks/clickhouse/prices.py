"""Prices: per model and class, effective from a time on; integer money.

A price is USD per million tokens (classes ``input``, ``cached_input``, ``output``), per GPU-hour
(``gpu_hour``) or per GiB-hour of KV cache held (``kv``: memory-time, docs/cost-model.md), with at
most six decimals, stored as an integer number of micro-USD. Prices are
set one at a time or loaded from a TOML or CSV file (``sparseety prices load``)::

    # prices.toml                              # prices.csv
    [[prices]]                                 model,token_class,usd,effective_from
    model = "llama-3-8b"                       llama-3-8b,input,0.15,2025-01-01T00:00:00Z
    effective_from = 2025-01-01T00:00:00Z      llama-3-8b,output,0.60,2025-01-01T00:00:00Z
    input = "0.15"
    cached_input = "0.075"
    output = "0.60"
    gpu_hour = "2.50"
    kv = "0.05"

A TOML entry may also name one class with the CSV's columns (``token_class = "input"``,
``usd = "0.15"``). The format: docs/cost-model.md, "Price files". Setting a price for the same
model, class and effective time again replaces it.
"""

from __future__ import annotations

import csv
import io
import re
import time
import tomllib
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparseety.errors import ConfigError
from sparseety.times import to_ns

from .migrate import on_cluster

if TYPE_CHECKING:
    from .client import Store

PRICE_CLASSES = (
    "input",
    "cached_input",
    "output",
    "gpu_hour",
    "kv",
    "reasoning_output",
    # issue 36 (migration 017; docs/cost-model.md, "The bill of 2026")
    "cache_write",
    "cached_input_cpu_offload",
    "cached_input_external",
    "cached_input_host",
    "cached_input_storage",
    "image_input",
    "audio_input",
    "video_input",
    "encoder_compute",
    "encoder_cache_read",
    "service_tier_multiplier",
    "cache_write_ttl_multiplier",
)

#: Classes that hold a factor (not USD) for the value their entry's ``qualifier`` names: the
#: service tier, the cache TTL. Every other class has no qualifier.
MULTIPLIER_CLASSES = ("service_tier_multiplier", "cache_write_ttl_multiplier")

#: The unit each class is priced in (token classes: per million tokens).
PRICE_UNITS = {
    "gpu_hour": "GPU-hour",
    "kv": "GiB-hour of KV cache held",
    "encoder_compute": "1M encoder tokens",
    "encoder_cache_read": "1M encoder tokens",
    "service_tier_multiplier": "factor on the request's token cost",
    "cache_write_ttl_multiplier": "factor on the cache_write price",
}
MICRO = Decimal(1_000_000)


@dataclass(frozen=True)
class Price:
    """One price.

    Attributes:
        model: Model name as requests carry it.
        token_class: One of :data:`PRICE_CLASSES`.
        usd: USD per million tokens, per GPU-hour for ``gpu_hour``, per GiB-hour for ``kv``.
        effective_from_ns: Applies to requests finished at or after this time (0 = always).
        note: Free text (source of the price).
    """

    model: str
    token_class: str
    usd: Decimal
    effective_from_ns: int = 0
    note: str = ""

    def __post_init__(self) -> None:
        # money is never a float: whatever came in goes through its text to a checked Decimal
        object.__setattr__(self, "usd", parse_usd(self.usd, where=f"{self.model} {self.token_class}"))

    @property
    def micro(self) -> int:
        """The price in integer micro-USD."""
        return int(self.usd * MICRO)


#: The largest price of one unit (1M tokens, a GPU-hour, a GiB-hour): far above any list price,
#: and far below what the store's integer micro-USD and its cost sums can hold.
MAX_USD = Decimal(1_000_000)
_PLAIN_DECIMAL = re.compile(r"\d+(\.\d+)?")


def parse_usd(value: Any, *, where: str = "price") -> Decimal:
    """A non-negative USD amount written as a plain decimal (``0.15``, ``12``; floats go through
    their text), with at most six decimals, at most :data:`MAX_USD`.

    Raises:
        ConfigError: naming the rule broken: not a number, negative, not plain decimal text
            (``1e3``), finer than a micro-dollar, or above the largest price.
    """
    text = str(value).strip()
    try:
        amount = Decimal(text)
    except InvalidOperation:
        raise ConfigError(f"{where}: {value!r} is not an amount in USD", value=text) from None
    if not amount.is_finite() or amount < 0:
        raise ConfigError(f"{where}: {value!r} must be a non-negative amount", value=text)
    if not _PLAIN_DECIMAL.fullmatch(text):
        raise ConfigError(
            f"{where}: {value!r} is not a plain decimal: write digits and at most one point, "
            f"e.g. 0.15 or 1000 (no exponent; quote it in TOML)",
            value=text,
        )
    if amount != amount.quantize(Decimal("0.000001")):
        raise ConfigError(f"{where}: {value!r} has more than six decimals (micro-USD)", value=text)
    if amount > MAX_USD:
        raise ConfigError(f"{where}: {value!r} is above the largest price, {MAX_USD} USD a unit", value=text)
    return amount


def parse_time(value: Any, *, where: str = "effective_from") -> int:
    """A time as ns: TOML datetime/date, ISO-8601 text (naive = UTC), or empty for 0."""
    if value in (None, "", 0):
        return 0
    if isinstance(value, datetime):
        return to_ns(value)
    if isinstance(value, date):
        return to_ns(datetime(value.year, value.month, value.day, tzinfo=UTC))
    try:
        return to_ns(datetime.fromisoformat(str(value).strip().replace("Z", "+00:00")))
    except ValueError:
        raise ConfigError(f"{where}: {value!r} is not an ISO-8601 time", value=str(value)) from None


def _check(p: Price, where: str) -> Price:
    if not p.model:
        raise ConfigError(f"{where}: model is empty")
    if p.token_class not in PRICE_CLASSES:
        raise ConfigError(
            f"{where}: token class {p.token_class!r} is not one of {', '.join(PRICE_CLASSES)}",
            token_class=p.token_class,
        )
    return p


def checked_price(
    model: str, token_class: str, usd: Any, effective_from: Any = 0, note: str = "", *, where: str = "price"
) -> Price:
    """One price from loose values (``effective_from``: ns, ISO-8601 text or empty), checked as a
    price file's entries are.

    Raises:
        ConfigError: an empty model, an unknown class, a bad amount or time.
    """
    eff = int(effective_from) if isinstance(effective_from, int) else parse_time(effective_from, where=where)
    return _check(Price(model, token_class, parse_usd(usd, where=where), eff, note), where)


def prices_from_toml(text: str, origin: str = "<toml>") -> list[Price]:
    """``[[prices]]`` tables with a model, an optional effective_from and one key per class."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{origin}: {exc}") from None
    out = []
    for i, entry in enumerate(data.get("prices", [])):
        where = f"{origin} prices[{i}]"
        if "token_class" in entry or "usd" in entry:
            # the CSV's columns as keys: one class per entry
            unknown = set(entry) - {"model", "token_class", "usd", "effective_from", "note"}
            if unknown:
                raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
            out.append(
                checked_price(
                    str(entry.get("model", "")),
                    str(entry.get("token_class", "")),
                    entry.get("usd", ""),
                    entry.get("effective_from") or "",
                    str(entry.get("note", "")),
                    where=where,
                )
            )
            continue
        unknown = set(entry) - {"model", "effective_from", "note", *PRICE_CLASSES}
        if unknown:
            raise ConfigError(
                f"{where}: unknown keys {sorted(unknown)}: an entry names one key per class "
                f"({', '.join(PRICE_CLASSES)}), or token_class and usd as the CSV does"
            )
        eff = parse_time(entry.get("effective_from"), where=where)
        for cls in PRICE_CLASSES:
            if cls in entry:
                usd = parse_usd(entry[cls], where=f"{where}.{cls}")
                out.append(
                    _check(Price(str(entry.get("model", "")), cls, usd, eff, entry.get("note", "")), where)
                )
    return out


def prices_from_csv(text: str, origin: str = "<csv>") -> list[Price]:
    """Rows ``model,token_class,usd[,effective_from[,note]]`` with that header."""
    reader = csv.DictReader(io.StringIO(text))
    need = {"model", "token_class", "usd"}
    if not need <= set(reader.fieldnames or ()):
        raise ConfigError(f"{origin}: header must name {sorted(need)} (and optionally effective_from, note)")
    out = []
    for line, row in enumerate(reader, start=2):
        where = f"{origin}:{line}"
        usd = parse_usd(row["usd"], where=where)
        eff = parse_time(row.get("effective_from"), where=where)
        out.append(
            _check(
                Price(row["model"].strip(), row["token_class"].strip(), usd, eff, row.get("note") or ""),
                where,
            )
        )
    return out


def load_prices_file(path: str | Path) -> list[Price]:
    """Prices from a ``.toml`` or ``.csv`` file.

    Raises:
        ConfigError: unreadable file, unknown format, or an invalid entry.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}", path=str(path)) from None
    if path.suffix == ".toml":
        return prices_from_toml(text, str(path))
    if path.suffix == ".csv":
        return prices_from_csv(text, str(path))
    raise ConfigError(f"{path}: price files are .toml or .csv", path=str(path))


def set_prices(store: Store, prices: list[Price]) -> int:
    """Store prices (replacing any with the same model, class and effective time)."""
    if not prices:
        return 0
    now = time.time_ns()
    store.insert(
        store.table("prices"),
        [
            [p.model for p in prices],
            [p.token_class for p in prices],
            [p.effective_from_ns for p in prices],
            [p.micro for p in prices],
            [p.note for p in prices],
            [now] * len(prices),
        ],
        ["model", "token_class", "effective_from_ns", "price_micro", "note", "set_ns"],
    )
    return len(prices)


def unseen_models(store: Store, models: list[str]) -> list[str]:
    """The ones of ``models`` that no stored request has (a price for a mistyped model applies to
    nothing: the caller warns)."""
    wanted = sorted(set(models))
    if not wanted:
        return []
    rows = store.query(
        f"SELECT DISTINCT model FROM {store.table('requests')} WHERE has({{m:Array(String)}}, model)",
        {"m": wanted},
    )
    seen = {str(r["model"]) for r in rows}
    return [m for m in wanted if m not in seen]


def delete_prices(
    store: Store, model: str, token_class: str | None = None, effective_from_ns: int | None = None
) -> int:
    """Delete the prices of ``model`` (of one class, of one effective time); returns how many.

    Raises:
        ConfigError: an empty model or an unknown class.
    """
    if not model:
        raise ConfigError("prices delete: the model is empty")
    if token_class is not None and token_class not in PRICE_CLASSES:
        raise ConfigError(
            f"prices delete: token class {token_class!r} is not one of {', '.join(PRICE_CLASSES)}",
            token_class=token_class,
        )
    where = ["model = {model:String}"]
    params: dict[str, Any] = {"model": model}
    if token_class is not None:
        where.append("token_class = {cls:String}")
        params["cls"] = token_class
    if effective_from_ns is not None:
        where.append("effective_from_ns = {eff:Int64}")
        params["eff"] = effective_from_ns
    cond = " AND ".join(where)
    table = store.table("prices")
    (row,) = store.query(f"SELECT count() AS n FROM {table} FINAL WHERE {cond}", params)
    if int(row["n"]):
        cluster = on_cluster(store.cluster)
        store.command(f"ALTER TABLE {table}{cluster} DELETE WHERE {cond} SETTINGS mutations_sync = 2", params)
    return int(row["n"])


def list_prices(store: Store, model: str | None = None) -> list[dict[str, Any]]:
    """Every stored price (current values), by model, class and effective time."""
    where, params = "1", {}
    if model is not None:
        where, params = "model = {model:String}", {"model": model}
    rows = store.query(
        "SELECT model, toString(token_class) AS token_class, effective_from_ns, price_micro, note "
        f"FROM {store.database}.prices FINAL WHERE {where} ORDER BY model, token_class, effective_from_ns",
        params,
    )
    return [
        {
            "model": r["model"],
            "token_class": r["token_class"],
            "usd": Decimal(int(r["price_micro"])) / MICRO,
            "unit": PRICE_UNITS.get(r["token_class"], "1M tokens"),
            "effective_from": datetime.fromtimestamp(int(r["effective_from_ns"]) / 1e9, UTC),
            "note": r["note"],
        }
        for r in rows
    ]
