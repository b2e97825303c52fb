"""vLLM server logs (``--enable-log-requests --enable-log-outputs``) -> request-level requests (pure).

What vLLM 0.32 writes, one record per line (``(<process> pid=<pid>) LEVEL MM-DD HH:MM:SS
[<file>:<line>] <message>``; fixtures in ``tests/data/vllm_log/``):

* ``Received request <id>: params: SamplingParams(... max_tokens=N ...), lora_request: ...`` (INFO);
* ``Request <id> details: prompt: '...', prompt_token_ids: [...], ...`` (DEBUG only);
* ``Added request <engine id>.`` (INFO): the engine's id, ``<id>-<8 hex>``, the id the plugin's
  events carry (used to deduplicate, :mod:`sparseety.offline.source_dedup`);
* ``Generated response <id> details: output_token_ids: [...]`` (DEBUG only) and
  ``Generated response <id>: output: '...', finish_reason: <reason>`` (INFO): the end of a
  non-streamed chat request; streamed ones log ``(streaming delta)`` per delta that produced text
  and ``(streaming complete)`` at the end;
* ``Aborted request(s) <engine ids>.`` and ``Request <id> aborted.`` (INFO): a client that went
  away; the request ends with finish reason ``abort``.

What is observed and what is modelled (each :class:`LogRequest` lists the accounting columns
that are modelled in ``modelled``; ``sparseety analyze`` reports them per request):

* observed: request id, engine id, prompt token ids (DEBUG), output token ids of a non-streamed
  response (DEBUG), finish reason of a non-streamed response, ``max_tokens``, LoRA name, the
  served model name (the server's ``non-default args`` startup line; a default otherwise);
* ``arrival_ts_ns``, ``finished_ts_ns``: always modelled. The log's clock has one-second
  resolution, no year and no zone: arrival is the ``Received`` line's second, finish the last
  ``Generated`` line's, in the year and UTC offset given to the parser;
* ``cache_read_tokens``, ``engine_cached_tokens``: always modelled (vLLM logs no prefix-cache
  hits): 0, so ``uncached_computed_tokens`` (prompt - cached + output - 1) is modelled too;
* ``output_tokens``: modelled for streamed responses, whose deltas without text are not logged
  (the logged ids are a lower bound), and without DEBUG (0);
* ``prompt_tokens``: modelled without DEBUG (0) or when the ids may be cut by ``--max-log-len``;
* ``finish_reason``: modelled for streamed responses (``unknown`` unless a delta logged one).

Line policy: only request records can be bad. A line that is not one is *skipped* and counted,
never dead-lettered: a vLLM-format line whose message is not about a request (startup, engine
steps) or a uvicorn access line (``ignored_lines``), and any other line (warnings printed by
libraries, tracebacks, progress bars: ``foreign_lines``). A line that claims to be a request
record (a vLLM-format line whose message starts as one does) and does not parse, or names a
request the log never received, is a bad line, dead-lettered with its line number; so is a line
over :data:`MAX_LOG_LINE_BYTES` (it cannot be read to tell). A request seen received but never
finished (vLLM's ``/v1/completions`` logs no output) is reported as unfinished and emits nothing.

Rotation: the segments of one log are read as one stream, oldest first
(:func:`rotation_order`: ``server.log.2``, ``server.log.1``, ``server.log``), so a request received
before a rotation and finished after it is one request; a segment that ends inside a line (a
``copytruncate`` rotation) continues that line in the next segment. The last line of the last
segment without its newline is a partial line (the server may still be writing it): it is used
when it parses and reported as partial otherwise, never dead-lettered.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any, BinaryIO

from sparseety import events as ev

from .errors import BadTraceLineError
from .jsonl import TraceEpoch, TraceRequest, engine_started, request_payloads

ENGINE_KIND = "vllm_log"

_LINE = re.compile(
    r"^(?:[^()]*)\((?P<proc>[\w-]+) pid=\d+\) (?P<level>[A-Z]+) "
    r"(?P<ts>\d\d-\d\d \d\d:\d\d:\d\d) \[[^\]]+:\d+\] (?P<msg>.*)$"
)
_UVICORN = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):\s{2,}\S")
#: vLLM prefixes what its child processes print with the process name; other loggers' lines there
_PROCESS = re.compile(r"^\((?:APIServer|EngineCore|Worker)[\w-]* pid=\d+\) ")
_IDS = r"(?P<ids>None|\[[0-9, ]*\])"
_STREAM = r"(?: \(streaming (?P<stream>delta|complete)\))?"
_RECEIVED = re.compile(
    r"^Received request (?P<rid>\S+): params: (?P<params>.*), lora_request: (?P<lora>.*)\.$"
)
_DETAILS = re.compile(
    r"^Request (?P<rid>\S+) details: prompt: .*, prompt_token_ids: " + _IDS + r", prompt_embeds"
)
_BODY = re.compile(r"^Request \S+ JSON body: ")
_ADDED = re.compile(r"^Added request (?P<erid>\S+)\.$")
_OUT_IDS = re.compile(
    r"^Generated response (?P<rid>\S+?)" + _STREAM + r" details: output_token_ids: " + _IDS + "$"
)
_OUTPUT = re.compile(
    r"^Generated response (?P<rid>\S+?)" + _STREAM + r": output: .*, finish_reason: (?P<reason>\S+)$"
)
_ABORTED = re.compile(r"^Aborted request\(s\) (?P<ids>.+)\.$")
_ABORTED_ONE = re.compile(r"^Request (?P<rid>\S+) aborted\.$")
_REQUEST_WORDS = ("Received request", "Request ", "Added request", "Generated response", "Aborted request")
#: Accounting columns a log never observes (names as in the requests table).
ALWAYS_MODELLED = (
    "arrival_ts_ns",
    "finished_ts_ns",
    "cache_read_tokens",
    "engine_cached_tokens",
    "uncached_computed_tokens",
)
#: The server's startup line that names the served model (``--served-model-name``, else ``--model``).
_ARGS = re.compile(r"^non-default args: ")
_SERVED = re.compile(r"'served_model_name': \['([^']*)'")
_MODEL = re.compile(r"'model': '([^']*)'")
_MAX_TOKENS = re.compile(r"\bmax_tokens=(\d+)")
_LORA = re.compile(r"lora_name='([^']*)'")


@dataclass
class LogRequest:
    """One request as the log tells it (times in ns; ``modelled`` names the fields not observed)."""

    request_id: str
    line: int  # where it was received (its first line)
    arrival_ns: int
    finish_line: int = 0
    engine_request_id: str = ""
    finished_ns: int = 0
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_seen: bool = False
    finish_reason: str = ""
    max_tokens: int | None = None
    lora_name: str | None = None
    model: str = ""
    streamed: bool = False
    modelled: set[str] = field(default_factory=lambda: set(ALWAYS_MODELLED))

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids or [])

    @property
    def output_tokens(self) -> int:
        return len(self.output_token_ids)

    def trace_request(self, tenant: str, model: str) -> TraceRequest:
        """The request-level record the trace epoch emits (engine id preferred: dedup key)."""
        return TraceRequest(
            request_id=self.engine_request_id or self.request_id,
            tenant=tenant,
            model=model,
            arrival_ns=self.arrival_ns,
            first_token_ns=0,
            finished_ns=max(self.finished_ns, self.arrival_ns),
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.output_tokens,
            cached_tokens=0,
            finish_reason=self.finish_reason or "unknown",
            max_tokens=self.max_tokens,
        )


@dataclass
class LogParse:
    """What the parser read: finished requests, and what it did not use."""

    requests: list[LogRequest] = field(default_factory=list)
    unfinished: list[LogRequest] = field(default_factory=list)
    ignored_lines: int = 0
    #: Lines not in vLLM's log format (library warnings, tracebacks, progress bars): skipped.
    foreign_lines: int = 0
    partial: list[tuple[str, int]] = field(default_factory=list)  # (segment, line) of a cut last line

    @property
    def skipped_lines(self) -> int:
        """Lines that are not request records (vLLM's other lines and foreign ones): skipped."""
        return self.ignored_lines + self.foreign_lines


def rotation_order(paths: Iterable[str | Path]) -> list[Path]:
    """Segments of rotated logs, oldest first: ``x.log.3, x.log.2, x.log.1, x.log``."""

    def key(p: Path) -> tuple[str, int]:
        m = re.fullmatch(r"(.+)\.(\d+)", p.name)
        return (str(p.with_name(m.group(1))), -int(m.group(2))) if m else (str(p), 0)

    return sorted((Path(p) for p in paths), key=key)


def log_base(path: Path) -> str:
    """The name a rotated segment belongs to (``server.log.1`` -> ``server.log``)."""
    m = re.fullmatch(r"(.+)\.(\d+)", path.name)
    return m.group(1) if m else path.name


def _ids(text: str, line: int) -> list[int] | None:
    if text == "None":
        return None
    body = text[1:-1].strip()
    try:
        return [int(x) for x in body.split(",")] if body else []
    except ValueError:
        raise BadTraceLineError(line, "token id list is not a list of integers") from None


class VllmLogParser:
    """Folds log lines into requests (pure; feed segments with :meth:`lines`, then :meth:`finish`).

    Args:
        year: The year of the log's ``MM-DD`` dates (the first line's; a later month before an
            earlier one moves to the next year).
        utc_offset_s: The server's UTC offset (its log clock is local time).
        max_log_len: The server's ``--max-log-len``, if set: id lists that long may be cut, so
            those counts are marked modelled.
    """

    def __init__(self, *, year: int, utc_offset_s: int = 0, max_log_len: int | None = None) -> None:
        self.year = year
        self.tz = timezone(timedelta(seconds=utc_offset_s))
        self.max_log_len = max_log_len
        self.result = LogParse()
        self._open: dict[str, LogRequest] = {}  # request id -> request
        self._by_engine: dict[str, str] = {}  # engine request id -> request id
        self._last_month = 0
        #: The served model name, from the server's ``non-default args`` line ("" until seen).
        self.model = ""

    def _ns(self, ts: str) -> int:
        month = int(ts[:2])
        if month < self._last_month:
            self.year += 1
        self._last_month = month
        t = datetime.strptime(f"{self.year}-{ts}", "%Y-%m-%d %H:%M:%S").replace(tzinfo=self.tz)
        return int(t.astimezone(UTC).timestamp()) * 1_000_000_000

    def line(self, text: str, n: int) -> LogRequest | None:
        """Fold one line (without its newline); return the request it finished, if any.

        Raises:
            BadTraceLineError: a line this parser does not understand (the caller dead-letters it).
        """
        if not text.strip():
            return None
        m = _LINE.match(text)
        if m is None:
            if _UVICORN.match(text) or _PROCESS.match(text):
                self.result.ignored_lines += 1
            else:  # not a request record: skipped, not bad (docs/api.md, vLLM server logs)
                self.result.foreign_lines += 1
            return None
        msg = m.group("msg")
        if not msg.startswith(_REQUEST_WORDS):
            if _ARGS.match(msg) and (found := _SERVED.search(msg) or _MODEL.search(msg)):
                self.model = found.group(1)
            self.result.ignored_lines += 1
            return None
        ts = self._ns(m.group("ts"))
        if mm := _RECEIVED.match(msg):
            rid = mm.group("rid")
            req = self._open.get(rid) or LogRequest(rid, n, ts)
            req.arrival_ns = ts
            req.line = n
            if mt := _MAX_TOKENS.search(mm.group("params")):
                req.max_tokens = int(mt.group(1))
            if ml := _LORA.search(mm.group("lora")):
                req.lora_name = ml.group(1)
            self._open[rid] = req
            return None
        if mm := _DETAILS.match(msg):
            ids = _ids(mm.group("ids"), n)
            # the details line comes before "Received": it opens the request
            req = self._open.setdefault(mm.group("rid"), LogRequest(mm.group("rid"), n, ts))
            req.prompt_token_ids = ids
            if ids is not None and self.max_log_len is not None and len(ids) >= self.max_log_len:
                req.modelled.add("prompt_tokens")
            return None
        if _BODY.match(msg):
            self.result.ignored_lines += 1
            return None
        if mm := _ADDED.match(msg):
            erid = mm.group("erid")
            base = erid.rsplit("-", 1)[0]
            rid = base if base in self._open else erid if erid in self._open else None
            if rid is None:
                raise BadTraceLineError(n, "engine request of no received request")
            self._open[rid].engine_request_id = erid
            self._by_engine[erid] = rid
            return None
        if mm := _OUT_IDS.match(msg):
            req = self._request(mm.group("rid"), n)
            ids = _ids(mm.group("ids"), n)
            if mm.group("stream"):
                req.streamed = True
            if ids is not None:
                req.output_token_ids.extend(ids)
                req.output_seen = True
                if self.max_log_len is not None and len(ids) >= self.max_log_len:
                    req.modelled.add("output_tokens")
            return None
        if mm := _OUTPUT.match(msg):
            req = self._request(mm.group("rid"), n)
            stream = mm.group("stream")
            reason = mm.group("reason")
            req.finished_ns = ts
            if stream == "delta":
                req.streamed = True
                if reason != "None":
                    req.finish_reason = reason
                return None
            if stream == "complete":
                req.streamed = True
                req.modelled |= {"output_tokens"}
                if not req.finish_reason:
                    req.modelled.add("finish_reason")
            else:
                req.finish_reason = reason
            req.finish_line = n
            return self._finish(req)
        if mm := _ABORTED.match(msg):
            done = None
            for erid in mm.group("ids").split(","):
                rid = self._by_engine.get(erid.strip())
                if rid is not None and rid in self._open:
                    req = self._open[rid]
                    req.finished_ns = ts
                    req.finish_reason = "abort"
                    req.finish_line = n
                    done = self._finish(req)
            return done
        if mm := _ABORTED_ONE.match(msg):  # follows "Aborted request(s)"; ends it if that was lost
            req_open = self._open.get(mm.group("rid"))
            if req_open is None:
                self.result.ignored_lines += 1
                return None
            req_open.finished_ns = ts
            req_open.finish_reason = "abort"
            req_open.finish_line = n
            return self._finish(req_open)
        raise BadTraceLineError(n, "request log line in an unknown format")

    def _request(self, rid: str, n: int) -> LogRequest:
        req = self._open.get(rid)
        if req is None:
            raise BadTraceLineError(n, f"response of a request never received ({rid!r})")
        return req

    def _finish(self, req: LogRequest) -> LogRequest:
        del self._open[req.request_id]
        req.model = self.model
        self._by_engine.pop(req.engine_request_id, None)
        if req.prompt_token_ids is None:
            req.modelled.add("prompt_tokens")
        if not req.output_seen:
            req.modelled.add("output_tokens")
        self.result.requests.append(req)
        return req

    def finish(self) -> LogParse:
        """End of input: requests still open are unfinished."""
        self.result.unfinished = list(self._open.values())
        self._open.clear()
        return self.result


#: A longer line is one bad line, read no further into memory (a DEBUG line of a 128k-token prompt
#: is about 1 MiB).
MAX_LOG_LINE_BYTES = 16 * 1024 * 1024
#: What :func:`iter_segments` yields as the text of a line over the limit.
TOO_LONG = "\x00too long"


def _lines(fh: BinaryIO, limit: int) -> Iterator[bytes | None]:
    """The file's lines (a last one maybe without its newline); ``None`` for a line over ``limit``."""
    while True:
        raw = fh.readline(limit + 1)
        if not raw:
            return
        if len(raw) > limit and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):
                raw = fh.readline(1 << 20)
            yield None
            continue
        yield raw


def iter_segments(
    paths: list[Path], max_line_bytes: int = MAX_LOG_LINE_BYTES
) -> Iterator[tuple[Path, int, str, bool]]:
    """(segment, line number, text, is the cut last line) over rotated segments, oldest first.

    A segment that ends without a newline continues its last line in the next segment (reported
    at the line where it started); the last segment's cut last line comes with ``True``. A line
    over ``max_line_bytes`` comes as :data:`TOO_LONG`.
    """
    carry: tuple[Path, int, bytes] | None = None
    for i, path in enumerate(paths):
        with path.open("rb") as fh:
            n = 0
            for raw in _lines(fh, max_line_bytes):
                n += 1
                if raw is None:
                    seg_, n_ = (carry[0], carry[1]) if carry else (path, n)
                    carry = None
                    yield seg_, n_, TOO_LONG, False
                    continue
                if carry is not None:
                    seg, at, head = carry
                    carry = None
                    raw = head + raw
                    path_, n_ = seg, at
                else:
                    path_, n_ = path, n
                if raw.endswith(b"\n"):
                    yield path_, n_, raw.decode("utf-8", "replace").rstrip("\r\n"), False
                else:
                    carry = (path_, n_, raw)
        if carry is not None and i == len(paths) - 1:
            seg, at, head = carry
            yield seg, at, head.decode("utf-8", "replace"), True


class LogEpoch(TraceEpoch):
    """A trace epoch of a vLLM log: ``engine_kind = vllm_log``, prompt ids where the log has them."""

    started: bool

    def __init__(self, engine_name: str, epoch: str, source: str, *, with_ids: bool) -> None:
        super().__init__(engine_name, epoch, source)
        self.with_ids = with_ids

    def engine_started_payload(self) -> dict[str, Any]:
        payload = engine_started(self.source)
        payload["engine_kind"] = ENGINE_KIND
        payload["privacy_mode"] = "raw" if self.with_ids else "none"
        return payload

    def log_request(self, req: LogRequest, tenant: str, model: str) -> Iterator[dict[str, Any]]:
        """The request's envelopes (RequestStarted carries the logged prompt ids; ``model`` when
        the log names no served model)."""
        trace = req.trace_request(tenant, req.model or model)
        payloads = request_payloads(trace)
        if self.with_ids and req.prompt_token_ids:
            payloads[0][1]["prompt_token_ids"] = list(req.prompt_token_ids)
        if not self.started:
            self.started = True
            yield self._wrap(trace.finished_ns, ev.ENGINE_STARTED, self.engine_started_payload())
        for payload_type, payload in payloads:
            yield self._wrap(trace.finished_ns, payload_type, payload)


def log_epoch(paths: list[Path], engine_name: str | None = None, *, with_ids: bool = True) -> LogEpoch:
    """The trace epoch of a log's segments: named ``vllm-log-<log name>``, its epoch the SHA-256 of
    the segments (the same log read again, by ``ingest`` or ``analyze``, gives the same uids)."""
    h = hashlib.sha256()
    for p in paths:
        with p.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    base = log_base(paths[-1])
    return LogEpoch(engine_name or f"vllm-log-{base}", h.hexdigest()[:16], base, with_ids=with_ids)


def read_log(
    paths: list[Path],
    parser: VllmLogParser,
    on_bad: Callable[[Path, BadTraceLineError], None],
) -> Iterator[LogRequest]:
    """The finished requests of a log's segments (oldest first), in finishing order.

    Bad lines go to ``on_bad`` with their segment (the exception has the line number and bytes);
    a cut last line that does not parse is recorded in ``parser.result.partial``. Call
    ``parser.finish()`` afterwards for the unfinished requests.
    """
    for path, n, text, cut in iter_segments(paths):
        if text is TOO_LONG:
            on_bad(path, BadTraceLineError(n, f"line over {MAX_LOG_LINE_BYTES} bytes", raw=b""))
            continue
        try:
            done = parser.line(text, n)
        except BadTraceLineError as exc:
            if cut:  # the server may still be writing it: not bad, not there yet
                parser.result.partial.append((str(path), n))
                continue
            exc.raw = text.encode("utf-8", "replace")
            on_bad(path, exc)
            continue
        if done is not None:
            yield done
