"""The ledger against a list standing in for Kafka and a real journal in a tmp folder: admission
within the memory budget, spilling when Kafka is away or the budget is spent, in-order drain,
failed deliveries retried first, and drop counting."""

from __future__ import annotations

from pathlib import Path

from sparseety.producers.ledger import MSG_OVERHEAD, Ledger, OnDelivery


class _Err:
    def __init__(self, name: str) -> None:
        self._name = name

    def name(self) -> str:
        return self._name


class _Msg:
    def __init__(self, value: bytes) -> None:
        self._value = value

    def value(self) -> bytes:
        return self._value


class Kafka:
    """Takes messages while ``up``; :meth:`ack` and :meth:`fail` play the delivery reports."""

    def __init__(self) -> None:
        self.key = b"engine"
        self.up = True
        self.sent: list[tuple[bytes, OnDelivery]] = []
        self.acked: list[bytes] = []

    def produce(self, value: bytes, on_delivery: OnDelivery) -> bool:
        if not self.up:
            return False
        self.sent.append((value, on_delivery))
        return True

    def ack(self) -> None:
        sent, self.sent = self.sent, []
        for value, on_delivery in sent:
            self.acked.append(value)
            on_delivery(None, _Msg(value))

    def fail(self, name: str = "_TRANSPORT") -> None:
        sent, self.sent = self.sent, []
        for value, on_delivery in sent:
            on_delivery(_Err(name), _Msg(value))


def _values(count: int, start: int = 0) -> list[bytes]:
    return [f"event-{i:04d}".encode() for i in range(start, start + count)]


def _ledger(kafka: Kafka, tmp_path: Path, *, messages: int = 100, journal_max: int = 1 << 20) -> Ledger:
    ledger = Ledger(
        kafka,
        limit_bytes=messages * (len(_values(1)[0]) + MSG_OVERHEAD),
        journal_dir=tmp_path / "journal",
        journal_max_bytes=journal_max,
        stream="core",
    )
    ledger.bind(tmp_path / "journal")
    return ledger


def _drain(kafka: Kafka, ledger: Ledger, rounds: int = 50) -> None:
    for _ in range(rounds):
        ledger.requeue_failed()
        ledger.pump()
        ledger.flush_journal()
        kafka.ack()
        if ledger.idle and not ledger.pending:
            return


def test_admits_within_budget(tmp_path: Path) -> None:
    kafka = Kafka()
    ledger = _ledger(kafka, tmp_path)
    for value in _values(5):
        ledger.route(value)
    assert [value for value, _ in kafka.sent] == _values(5)
    assert ledger.inflight == 5 and not ledger.backlog and ledger.journal is None
    kafka.ack()
    assert ledger.stats.produced == 5 and ledger.stats.spilled == 0
    assert ledger.idle and ledger.memory_bytes == 0


def test_kafka_away_backlogs_then_spills(tmp_path: Path) -> None:
    kafka = Kafka()
    kafka.up = False
    ledger = _ledger(kafka, tmp_path, messages=3)
    for value in _values(10):
        ledger.route(value)
    assert len(ledger.backlog) == 3
    assert ledger.stats.spilled == 7 and ledger.journal is not None and ledger.journal_bytes > 0
    assert not ledger.idle


def test_over_budget_spills_while_kafka_holds_messages(tmp_path: Path) -> None:
    kafka = Kafka()
    ledger = _ledger(kafka, tmp_path, messages=4)
    for value in _values(10):
        ledger.route(value)
    assert ledger.inflight == 4 and not ledger.backlog
    assert ledger.stats.spilled == 6


def test_drains_in_order_and_new_events_wait_behind_the_journal(tmp_path: Path) -> None:
    kafka = Kafka()
    kafka.up = False
    ledger = _ledger(kafka, tmp_path, messages=3)
    for value in _values(10):
        ledger.route(value)
    kafka.up = True
    for value in _values(5, start=10):
        ledger.route(value)  # the journal holds events: these go behind them
    assert ledger.stats.spilled == 12
    _drain(kafka, ledger)
    assert kafka.acked == _values(15)
    assert ledger.stats.produced == 15 and ledger.stats.drained == 12
    assert ledger.idle and not ledger.pending


def test_failed_deliveries_go_back_to_the_head_of_the_line(tmp_path: Path) -> None:
    kafka = Kafka()
    ledger = _ledger(kafka, tmp_path)
    for value in _values(3):
        ledger.route(value)
    kafka.fail()
    assert ledger.inflight == 0 and len(ledger.failed) == 3
    ledger.requeue_failed()  # the supervisor does so right after polling the delivery reports
    ledger.route(_values(1, start=3)[0])  # waits behind the requeued ones
    assert not kafka.sent
    _drain(kafka, ledger)
    assert kafka.acked == _values(4)
    assert ledger.stats.dropped == 0


def test_counts_drops_by_reason(tmp_path: Path) -> None:
    kafka = Kafka()
    kafka.up = False
    ledger = _ledger(kafka, tmp_path, messages=1, journal_max=100)
    for value in _values(20):
        ledger.route(value)
    assert ledger.stats.dropped_by.get("journal_full", 0) > 0
    assert 1 + ledger.stats.spilled + ledger.stats.dropped == 20

    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    broken = Ledger(kafka, limit_bytes=0, journal_dir=blocked, journal_max_bytes=1 << 20, stream="core")
    broken.route(b"x")
    broken.route(b"y")
    assert broken.stats.dropped_by == {"journal_error": 2}

    kafka.up = True
    lost = _ledger(kafka, tmp_path / "lost")
    for value in _values(3):
        lost.route(value)
    lost.forget_inflight()  # a purged client never handed them back
    assert lost.stats.dropped_by == {"purge_lost": 3} and lost.inflight == 0 and lost.memory_bytes == 0


def test_shutdown_puts_the_backlog_in_front_of_the_journal(tmp_path: Path) -> None:
    kafka = Kafka()
    kafka.up = False
    ledger = _ledger(kafka, tmp_path, messages=3)
    for value in _values(6):
        ledger.route(value)
    ledger.spill_backlog()
    ledger.flush_journal()
    assert not ledger.backlog and ledger.stats.spilled == 6
    kafka.up = True
    _drain(kafka, ledger)
    assert kafka.acked == _values(6)
