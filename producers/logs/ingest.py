"""Publish a trace file to the engine-events topic (recordings and JSONL logs).

Bad input policy: a line (JSONL) or record (recording) that cannot be used is **skipped,
reported and dead-lettered** — counted in :attr:`IngestReport.bad`, with its line number and
reason in :attr:`IngestReport.errors` (the first :data:`MAX_ERRORS`), and sent to the dlq topic as
a DeadLetter (component ``ingest``, topic ``file:<path>``, offset = line or record number, value =
its bytes) — and the rest of the file is still published. With ``strict=True`` the whole file is
checked first and nothing is published when any line is bad
(:class:`~sparseety.producers.logs.errors.BadTraceLineError` for the first one). A recording cut
short ends the read there (nothing after it can be framed); that is one bad record. A vLLM log
differs: only a line that claims to be a request record and fails is bad (dead-lettered); the
server's other lines and foreign ones are counted in :attr:`IngestReport.skipped`
(:mod:`~sparseety.producers.logs.vllm_log`, line policy).

Delivery: confluent-kafka's idempotent producer, keyed by engine name (one engine's events stay
in order in one partition); the ingest returns once Kafka acknowledged every event, or raises
:class:`~sparseety.producers.logs.errors.TraceError` naming how many were not delivered.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from sparseety import events as ev
from sparseety.config import Config
from sparseety.deadletter_limits import MAX_DEAD_LETTER_BYTES
from sparseety.kafka import make_decoder, make_encoder, make_producer
from sparseety.tenants import check_tenant

from .errors import BadTraceLineError, TraceError
from .format import Format, detect_format, recording_events
from .jsonl import MAX_DEPTH, MAX_LINE_BYTES, TraceEpoch, TraceRequest, parse_line
from .vllm_log import LogRequest, VllmLogParser, log_epoch, read_log, rotation_order

#: (bytes read, file size); may raise to abort the ingest (a cancelled job).
Progress = Callable[[int, int], None]
MAX_ERRORS = 100
COMPONENT = "ingest"
_PROGRESS_EVERY = 2000


@dataclass
class IngestReport:
    """What an ingest read and published."""

    path: str
    format: str
    total_bytes: int
    topic: str = ""
    bytes_read: int = 0
    records_read: int = 0
    events_published: int = 0
    requests: int = 0
    bad: int = 0
    dead_lettered: int = 0
    errors: list[tuple[int, str]] = field(default_factory=list)
    engine_ids: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: vLLM logs: lines that are not request records (skipped, not bad, not dead-lettered).
    skipped: int = 0
    #: vLLM logs: requests received but never finished in the log, and a cut last line.
    unfinished: int = 0
    partial: int = 0
    #: What to do when the input held nothing to account (a vLLM log without request lines).
    hint: str = ""
    #: Called with each bad line (its bytes on ``exc.raw``): the ingest sends it to the dlq topic.
    on_bad: Callable[[BadTraceLineError], None] | None = field(default=None, repr=False, compare=False)

    @property
    def events_per_s(self) -> float:
        """Events published per second of wall time."""
        return self.events_published / self.seconds if self.seconds else 0.0

    def bad_line(self, exc: BadTraceLineError, raw: bytes | None = None) -> None:
        """Count one bad line, keep its reason (the first :data:`MAX_ERRORS`), dead-letter it."""
        if exc.raw is None:
            exc.raw = raw
        self.bad += 1
        if len(self.errors) < MAX_ERRORS:
            self.errors.append((exc.line, exc.reason))
        if self.on_bad is not None:
            self.on_bad(exc)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (the collect job's result)."""
        return {
            "path": self.path,
            "format": self.format,
            "topic": self.topic,
            "bytes": self.bytes_read,
            "records_read": self.records_read,
            "events_published": self.events_published,
            "requests": self.requests,
            "bad_lines": self.bad,
            "dead_lettered": self.dead_lettered,
            "skipped_lines": self.skipped,
            "errors": [{"line": n, "reason": r} for n, r in self.errors],
            "engine_ids": list(self.engine_ids),
            "unfinished_requests": self.unfinished,
            "partial_lines": self.partial,
            "seconds": round(self.seconds, 3),
            "events_per_s": round(self.events_per_s, 1),
            **({"hint": self.hint} if self.hint else {}),
        }


class KafkaPublisher:
    """Produces (key, value) pairs to one topic and waits for every acknowledgement.

    Args:
        cfg: Kafka settings.
        topic: Destination topic.
        producer: A confluent-kafka Producer (default: :func:`sparseety.kafka.make_producer`).
    """

    def __init__(self, cfg: Config, topic: str, producer: Any = None) -> None:
        self.topic = topic
        self.producer = producer if producer is not None else make_producer(cfg)
        self.sent = 0
        self.delivered = 0
        self.failed = 0
        self.first_error = ""

    def _on_delivery(self, err: Any, _msg: Any) -> None:
        if err is None:
            self.delivered += 1
        else:
            self.failed += 1
            self.first_error = self.first_error or str(err)

    def send(self, key: bytes, value: bytes) -> None:
        """Queue one message, waiting for room when the local queue is full."""
        while True:
            try:
                self.producer.produce(self.topic, key=key, value=value, on_delivery=self._on_delivery)
                break
            except BufferError:
                self.producer.poll(0.1)
        self.sent += 1
        if self.sent % 1000 == 0:
            self.producer.poll(0)

    def close(self, timeout_s: float = 60.0) -> None:
        """Wait until Kafka acknowledged everything sent.

        Raises:
            TraceError: messages not delivered within ``timeout_s``, or delivery failed.
        """
        left = self.producer.flush(timeout_s)
        if left or self.failed:
            raise TraceError(
                f"{left + self.failed} of {self.sent} events were not delivered to {self.topic}"
                + (f" (first error: {self.first_error})" if self.first_error else " (timed out)"),
                topic=self.topic,
                undelivered=left + self.failed,
            )


def _engine_name(path: Path) -> str:
    return f"trace-{path.stem}"


def file_digest(path: Path) -> str:
    """SHA-256 of the file (hex): the epoch of a JSONL trace, so a re-ingest is recognisable."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class Limits:
    """What one JSONL line may hold (the defaults are documented in :mod:`..jsonl`)."""

    max_line_bytes: int = MAX_LINE_BYTES
    max_depth: int = MAX_DEPTH


def _read_lines(fh: BinaryIO, limit: int) -> Iterator[tuple[bytes, int, str]]:
    """(line, its length, reason) per line, holding at most ``limit`` + 1 bytes of one line in
    memory: a longer line comes back as its first bytes with the reason (length, SHA-256), so a
    line of any size (even a file without a newline) is one bad line, not an exhausted process."""
    while True:
        line = fh.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit or line.endswith(b"\n"):  # limit + 1 with its newline: parse_line judges
            yield line, len(line), ""
            continue
        head = line
        digest = hashlib.sha256(line)
        size = len(line)
        while not line.endswith(b"\n"):
            line = fh.readline(1 << 20)
            if not line:
                break
            digest.update(line)
            size += len(line)
        yield (
            head[:MAX_DEAD_LETTER_BYTES],
            size,
            f"line is {size} bytes, over the {limit}-byte limit "
            f"[value truncated to {min(len(head), MAX_DEAD_LETTER_BYTES)} bytes; "
            f"sha256 {digest.hexdigest()}]",
        )


def _jsonl_requests(
    path: Path,
    report: IngestReport,
    default_tenant: str,
    default_model: str,
    progress: Progress | None,
    limits: Limits = Limits(),
) -> Iterator[tuple[int, TraceRequest, bytes]]:
    """Valid requests of a JSONL file with their line numbers and lines; bad lines go to ``report`` (or raise,
    via the caller)."""
    seen: set[str] = set()
    with path.open("rb") as fh:
        for n, (line, size, too_long) in enumerate(_read_lines(fh, limits.max_line_bytes), start=1):
            report.bytes_read += size
            if progress and n % _PROGRESS_EVERY == 0:
                progress(report.bytes_read, report.total_bytes)
            if too_long:
                report.records_read += 1
                report.bad_line(BadTraceLineError(n, too_long), line)
                continue
            if not line.strip():
                continue
            report.records_read += 1
            try:
                req = parse_line(
                    line,
                    n,
                    default_tenant=default_tenant,
                    default_model=default_model,
                    max_line_bytes=limits.max_line_bytes,
                    max_depth=limits.max_depth,
                )
                if req is None:
                    continue
                if req.request_id in seen:
                    raise BadTraceLineError(n, f"duplicate request id {req.request_id!r} in this file")
                seen.add(req.request_id)
            except BadTraceLineError as exc:
                report.bad_line(exc, line)
                continue
            yield n, req, line


#: The valid requests of a JSONL file, its bad lines into the report (``sparseety analyze`` too).
jsonl_requests = _jsonl_requests


def _recording_events(
    path: Path, report: IngestReport, cfg: Config, progress: Progress | None
) -> Iterator[tuple[int, dict[str, Any], bytes]]:
    """(record number, decoded EngineEvent, original bytes) of a recording's valid records."""
    with path.open("rb") as fh:
        for n, value, item in recording_events(fh, make_decoder(cfg)):
            if value is not None:
                report.bytes_read += 4 + len(value)
                report.records_read += 1
                if progress and n % _PROGRESS_EVERY == 0:
                    progress(report.bytes_read, report.total_bytes)
            if isinstance(item, BadTraceLineError):
                report.bad_line(item)
                continue
            assert value is not None  # only a framing error comes without bytes
            yield n, item, value


def _check(
    cfg: Config, path: Path, fmt: Format, default_tenant: str, default_model: str, limits: Limits
) -> IngestReport:
    """Read the whole file without publishing (strict mode's first pass)."""
    report = IngestReport(str(path), fmt, path.stat().st_size)
    if fmt == "jsonl":
        for _ in _jsonl_requests(path, report, default_tenant, default_model, None, limits):
            pass
    else:
        for _ in _recording_events(path, report, cfg, None):
            pass
    return report


def ingest(
    cfg: Config,
    path: str | Path,
    *,
    fmt: str = "auto",
    engine_name: str | None = None,
    default_tenant: str = "",
    default_model: str = "",
    strict: bool = False,
    progress: Progress | None = None,
    producer: Any = None,
    limits: Limits = Limits(),
    segments: list[str | Path] | None = None,
    log_year: int | None = None,
    log_utc_offset_s: int = 0,
    log_select: Callable[[LogRequest], bool] | None = None,
    log_window_s: float | None = None,
    log_published: Callable[[LogRequest], None] | None = None,
) -> IngestReport:
    """Publish a trace file to ``cfg.topics.engine_events``.

    Args:
        cfg: Kafka, topics and schema settings.
        path: The trace file.
        fmt: ``recording``, ``jsonl`` or ``auto`` (detected from the first bytes).
        engine_name: Engine name of a JSONL trace (default ``trace-<file stem>``); recordings
            keep the engines they recorded.
        default_tenant, default_model: For JSONL lines without ``tenant`` / ``model``.
        strict: Publish nothing when any line is bad.
        progress: Called with (bytes read, file size) as the file is read.
        producer: A confluent-kafka Producer to use (tests); default one from ``cfg``.
        limits: Size and nesting limits of a JSONL line.
        segments: ``vllm-log``: older rotated segments of the same log, read before ``path``.
        log_year, log_utc_offset_s: ``vllm-log``: the year and UTC offset of the log's clock
            (default: the year of the oldest segment's modification time, UTC).
        log_select: ``vllm-log``: publish only the requests this accepts.
        log_window_s: ``vllm-log``: publish only the requests that finished within this many
            seconds of the log's last finished request (the log's own clock).
        log_published: ``vllm-log``: called with each request published (a collect job's report).

    Raises:
        TraceError: unreadable file, unknown format, delivery failed.
        BadTraceLineError: ``strict`` and a bad line (the first; the message counts all).
        InvalidTenantError: ``default_tenant`` is no tenant name (every line would be bad).
    """
    check_tenant(default_tenant, where="the default tenant")
    p = Path(path)
    try:
        with p.open("rb") as fh:
            head = fh.read(4096)  # a vLLM log may open with what libraries print
        total = p.stat().st_size
    except OSError as exc:
        raise TraceError(f"cannot read trace file {p}: {exc.strerror or exc}", path=str(p)) from None
    if fmt == "auto":
        resolved: Format = detect_format(head)
    elif fmt in ("recording", "jsonl", "vllm-log"):
        resolved = fmt  # type: ignore[assignment]
    else:
        raise TraceError(f"unknown trace format {fmt!r}: choose auto, recording, jsonl or vllm-log")
    started = time.monotonic()
    if resolved == "vllm-log":
        paths = rotation_order([*(segments or []), p])
        year = log_year or time.gmtime(paths[0].stat().st_mtime).tm_year
        parser = VllmLogParser(year=year, utc_offset_s=log_utc_offset_s)
        if strict:
            checked = IngestReport(str(p), resolved, total)
            for _ in read_log(paths, parser, lambda _p, exc: checked.bad_line(exc)):
                pass
            if checked.bad:
                line, reason = checked.errors[0]
                raise BadTraceLineError(
                    line, f"{reason} ({checked.bad} bad lines in all; nothing was published)", bad=checked.bad
                )
            parser = VllmLogParser(year=year, utc_offset_s=log_utc_offset_s)
    if strict and resolved != "vllm-log":
        checked = _check(cfg, p, resolved, default_tenant, default_model, limits)
        if checked.bad:
            line, reason = checked.errors[0]
            raise BadTraceLineError(
                line, f"{reason} ({checked.bad} bad lines in all; nothing was published)", bad=checked.bad
            )
    topic = cfg.topics.engine_events
    report = IngestReport(str(p), resolved, total, topic=topic)
    publisher = KafkaPublisher(cfg, topic, producer)
    encoder = make_encoder(cfg, "EngineEvent", topic)
    dlq = KafkaPublisher(cfg, cfg.topics.dlq, publisher.producer)
    dlq_encoder = make_encoder(cfg, "DeadLetter", cfg.topics.dlq)

    def dead_letter(exc: BadTraceLineError) -> None:
        record = ev.dead_letter(
            type(exc).__name__,
            exc.reason,
            COMPONENT,
            topic=f"file:{getattr(exc, 'segment', p)}",  # a rotated log's segment
            partition=-1,
            offset=exc.line,
            key=p.name.encode(),
            value=exc.raw,
        )
        dlq.send(p.name.encode(), dlq_encoder.encode(record))

    report.on_bad = dead_letter
    engines: dict[str, None] = {}
    if resolved == "vllm-log":
        epoch = log_epoch(paths, engine_name)
        engines[epoch.engine_id] = None
        key = epoch.engine_name.encode()
        report.total_bytes = sum(s.stat().st_size for s in paths)

        def bad_log_line(segment: Path, exc: BadTraceLineError) -> None:
            exc.segment = str(segment)  # type: ignore[attr-defined]
            report.records_read += 1
            report.bad_line(exc)

        logged = [0]

        def counted(items: Iterable[LogRequest]) -> Iterable[LogRequest]:
            for item in items:
                logged[0] += 1
                yield item

        requests: Iterable[LogRequest] = counted(read_log(paths, parser, bad_log_line))
        if log_select is not None:
            requests = filter(log_select, requests)
        if log_window_s is not None:
            held = list(requests)
            end = max((r.finished_ns for r in held), default=0)
            requests = [r for r in held if r.finished_ns >= end - int(log_window_s * 1e9)]
        for req in requests:
            report.records_read += 1
            for event in epoch.log_request(req, default_tenant, default_model or "vllm-log"):
                publisher.send(key, encoder.encode(event))
            report.requests += 1
            if log_published is not None:
                log_published(req)
        report.bytes_read = report.total_bytes
        parsed = parser.finish()
        report.unfinished = len(parsed.unfinished)
        report.skipped = parsed.skipped_lines
        report.partial = len(parsed.partial)
        if not logged[0] and not report.unfinished:
            report.hint = (
                "the log holds no request records: vLLM writes them only when the server runs with "
                "--enable-log-requests (and --enable-log-outputs for the outputs), with "
                "VLLM_LOGGING_LEVEL=DEBUG for the prompt token ids (docs/api.md, vLLM server logs)"
            )
        for event in epoch.stop():
            publisher.send(key, encoder.encode(event))
        if not epoch.started:
            engines.clear()
    elif resolved == "jsonl":
        trace = TraceEpoch(engine_name or _engine_name(p), file_digest(p)[:16], p.name)
        engines[trace.engine_id] = None
        key = trace.engine_name.encode()
        for n, trace_req, raw in _jsonl_requests(p, report, default_tenant, default_model, progress, limits):
            state = (trace.seq, trace.started, trace.last_ts)
            try:
                encoded = [encoder.encode(event) for event in trace.request(trace_req)]
            except Exception as exc:  # a value the parser let through but the contract refuses
                trace.seq, trace.started, trace.last_ts = state  # keep the epoch's seqs gap-free
                report.bad_line(BadTraceLineError(n, f"cannot encode: {type(exc).__name__}: {exc}"), raw)
                continue
            for value in encoded:
                publisher.send(key, value)
            report.requests += 1
        for event in trace.stop():
            publisher.send(key, encoder.encode(event))
        if not trace.started:
            engines.clear()
    else:
        reencode = bool(cfg.schema_registry.url)  # recordings hold single-object payloads
        for _, record, value in _recording_events(p, report, cfg, progress):
            engines.setdefault(record["engine_id"], None)
            if ev.payload_type(record) == ev.REQUEST_FINISHED:
                report.requests += 1
            publisher.send(record["engine_name"].encode(), encoder.encode(record) if reencode else value)
    publisher.close()
    dlq.close()
    report.events_published = publisher.delivered
    report.dead_lettered = dlq.delivered
    report.engine_ids = list(engines)
    report.seconds = time.monotonic() - started
    if progress:
        progress(report.bytes_read, report.total_bytes)
    return report
