"""``sparseety analyze INPUT... --out DIR``: the fold and the accounting over trace files, offline.

No Kafka, no worker, no store process: each input is decoded and checked as the worker checks
it (recordings), or parsed (JSONL request logs, vLLM server logs) into engine events, and folded
by the worker's :class:`~sparseety.streams.assembler.Assembler`, in memory (one per input). Its records are
what the worker would send to the timelines, usage and dlq topics; with ``--clickhouse DSN`` they
are written through the same :class:`~sparseety.sinks.clickhouse.writer.ClickHouseSink` the sink
process uses, so the stored rows equal the streaming pipeline's for the same recording.

Outputs in ``--out``:

* ``<input>.json`` (or ``.csv`` / ``.parquet``: the per-request rows only): one report per input;
  the JSON report holds the per-request rows, totals, bad lines with their numbers (also written
  as DeadLetter rows to ClickHouse when a DSN is given), usage windows, and for vLLM logs the
  unfinished requests and, per request, the fields that are modelled rather than observed;
* ``summary.<format>``: one row per input (status, requests, tokens) and the totals over all of
  them, each request counted once (:mod:`sparseety.offline.source_dedup`: a request of a vLLM log
  that a plugin recording also accounts is listed as a duplicate and not counted);
* ``analyze-state.json``: the finished inputs (path, size, SHA-256, report): a rerun skips an
  input whose files did not change. A failed input is retried ``retries`` times, then reported
  in the summary (``status: failed`` with the error) without stopping the others; it is not
  marked finished, so the next run tries it again.

Inputs: a recording or JSONL file per input; the segments of a rotated vLLM log
(``server.log.1 server.log``) are one input, named after the log. Recordings are folded before
logs, so that a log's duplicates of a recording are known before the log is reported. In
ClickHouse every record is written, duplicates included: the store's views count each request
once, whatever the order (``sinks/clickhouse/migrations/008_log_dedup.sql``).
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sparseety import events as ev
from sparseety.config import Config
from sparseety.errors import SparseetyError
from sparseety.kafka import make_decoder
from sparseety.offline.source_dedup import Counted, dedup_key, dedup_step
from sparseety.producers.logs.errors import BadTraceLineError, TraceError
from sparseety.producers.logs.format import detect_format, recording_events
from sparseety.producers.logs.ingest import IngestReport, file_digest, jsonl_requests
from sparseety.producers.logs.jsonl import TraceEpoch
from sparseety.producers.logs.vllm_log import VllmLogParser, log_base, log_epoch, read_log, rotation_order
from sparseety.streams.assembler import Assembler
from sparseety.streams.state import MemoryStore

FORMATS = ("json", "csv", "parquet")
INPUT_FORMATS = ("auto", "recording", "jsonl", "vllm-log")
STATE_FILE = "analyze-state.json"
#: Scalar columns of a RequestAccounting kept in the per-request rows (lists stay in ClickHouse).
ROW_FIELDS = (
    "request_uid",
    "engine_name",
    "engine_id",
    "request_id",
    "engine_kind",
    "tenant",
    "model",
    "lora_name",
    "arrival_ts_ns",
    "first_token_ts_ns",
    "finished_ts_ns",
    "finish_reason",
    "complete",
    "consistent",
    "prompt_tokens",
    "output_tokens",
    "cache_read_tokens",
    "uncached_computed_tokens",
    "recomputed_tokens",
    "recomputed_preemption_tokens",
    "recomputed_eviction_tokens",
    "draft_accepted_tokens",
    "draft_rejected_tokens",
    "draft_cut_tokens",
    "skipped_tokens",
    "window_released_tokens",
    "waste_tokens",
    "scheduled_tokens",
    "preemptions",
    "steps",
    "attention_pairs",
    "gpu_time_ns",
    "est_flops",
    "engine_prompt_tokens",
    "engine_output_tokens",
    "engine_cached_tokens",
)
#: Summed in the totals.
TOTAL_FIELDS = (
    "prompt_tokens",
    "output_tokens",
    "cache_read_tokens",
    "uncached_computed_tokens",
    "recomputed_tokens",
    "draft_accepted_tokens",
    "draft_rejected_tokens",
    "waste_tokens",
    "gpu_time_ns",
)
MAX_LISTED_BAD = 100

#: (inputs done, inputs planned, name of the input being read).
Progress = Callable[[int, int, str], None]


class AnalyzeError(SparseetyError):
    """An analyze run cannot start (no inputs, unusable output directory)."""


@dataclass
class AnalyzeInput:
    """One unit of analysis: a file, or the rotated segments of one vLLM log (oldest first)."""

    name: str
    paths: list[Path]
    format: str

    def fingerprint(self) -> list[dict[str, Any]]:
        """Path, size and SHA-256 of each file: a rerun skips the input when these are unchanged."""
        out = []
        for p in self.paths:
            h = hashlib.sha256()
            with p.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            out.append({"path": str(p.resolve()), "bytes": p.stat().st_size, "sha256": h.hexdigest()})
        return out


@dataclass
class Options:
    """How inputs are read (the CLI's options)."""

    input_format: str = "auto"
    tenant: str = ""
    model: str = ""
    log_year: int | None = None
    log_utc_offset_s: int = 0
    max_log_len: int | None = None


@dataclass
class InputResult:
    """What one input produced."""

    name: str
    format: str
    records: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    bad: int = 0
    bad_lines: list[dict[str, Any]] = field(default_factory=list)
    events: int = 0
    usage_windows: int = 0
    dead_letters: int = 0
    unfinished: list[dict[str, Any]] = field(default_factory=list)
    ignored_lines: int = 0
    skipped_lines: int = 0  # vLLM logs: lines that are not request records (not bad lines)
    partial_lines: list[dict[str, Any]] = field(default_factory=list)
    fold_summary: str = ""
    #: vLLM logs: request id -> the fields of its accounting that are modelled, not observed.
    rows_modelled: dict[str, list[str]] = field(default_factory=dict)

    def bad_line(self, path: Path, exc: BadTraceLineError) -> None:
        self.bad += 1
        if len(self.bad_lines) < MAX_LISTED_BAD:
            self.bad_lines.append({"file": str(path), "line": exc.line, "reason": exc.reason})
        self.records.append(
            (
                ev.DEAD_LETTER,
                ev.dead_letter(
                    type(exc).__name__,
                    exc.reason,
                    "analyze",
                    topic=f"file:{path}",
                    partition=-1,
                    offset=exc.line,
                    key=path.name.encode(),
                    value=exc.raw,
                ),
            )
        )


# --- planning ------------------------------------------------------------------------------------


def _detect(path: Path) -> str:
    with path.open("rb") as fh:
        head = fh.read(4096)
    try:
        return detect_format(head)
    except TraceError:
        if b" pid=" in head or path.suffix == ".log" or log_base(path) != path.name:
            return "vllm-log"
        raise


def plan(paths: list[str | Path], input_format: str = "auto") -> list[AnalyzeInput]:
    """Inputs in the order they are folded: recordings and JSONL first, then vLLM logs (rotated
    segments of one log grouped, oldest first).

    Raises:
        TraceError: a file is missing or of no known format.
    """
    files: list[AnalyzeInput] = []
    logs: dict[str, list[Path]] = {}
    for raw in paths:
        p = Path(raw)
        if not p.is_file():
            raise TraceError(f"no such input file: {p}", path=str(p))
        fmt = _detect(p) if input_format == "auto" else input_format
        if fmt == "vllm-log":
            logs.setdefault(str(p.with_name(log_base(p))), []).append(p)
        else:
            files.append(AnalyzeInput(_name(p), [p], fmt))
    out = sorted(files, key=lambda i: i.format != "recording")
    for base, segs in logs.items():
        out.append(AnalyzeInput(_name(Path(base)), rotation_order(segs), "vllm-log"))
    seen: dict[str, int] = {}
    for item in out:  # two inputs of the same file name in different folders
        n = seen.get(item.name, 0)
        seen[item.name] = n + 1
        if n:
            item.name = f"{item.name}-{n + 1}"
    return out


def _name(p: Path) -> str:
    # tests/data/<scenario>/events.bin: the folder says what it is
    return f"{p.parent.name}-{p.name}" if p.name == "events.bin" and p.parent.name else p.name


# --- reading ------------------------------------------------------------------------------------


def _recording_events(cfg: Config, path: Path, result: InputResult) -> Iterator[dict[str, Any]]:
    with path.open("rb") as fh:
        for _, _, item in recording_events(fh, make_decoder(cfg)):
            if isinstance(item, BadTraceLineError):
                result.bad_line(path, item)
            else:
                yield item


def _jsonl_events(path: Path, result: InputResult, opts: Options) -> Iterator[dict[str, Any]]:
    """The events ``sparseety ingest`` would publish for a JSONL file (same epoch, same uids), its
    bad lines (over-long, deep, invalid, duplicate ids) into ``result``."""
    trace = TraceEpoch(f"trace-{path.stem}", file_digest(path)[:16], path.name)
    report = IngestReport(str(path), "jsonl", path.stat().st_size)
    report.on_bad = lambda exc: result.bad_line(path, exc)
    for _n, req, _raw in jsonl_requests(path, report, opts.tenant, opts.model, None):
        yield from trace.request(req)
    yield from trace.stop()


def _log_events(inp: AnalyzeInput, result: InputResult, opts: Options) -> Iterator[dict[str, Any]]:
    year = opts.log_year or datetime.fromtimestamp(inp.paths[0].stat().st_mtime, UTC).year
    parser = VllmLogParser(year=year, utc_offset_s=opts.log_utc_offset_s, max_log_len=opts.max_log_len)
    epoch = log_epoch(inp.paths)
    model = opts.model or "vllm-log"
    for req in read_log(inp.paths, parser, result.bad_line):
        result.rows_modelled[req.engine_request_id or req.request_id] = sorted(req.modelled)
        yield from epoch.log_request(req, opts.tenant, model)
    parsed = parser.finish()
    result.ignored_lines = parsed.ignored_lines
    result.skipped_lines = parsed.skipped_lines
    result.partial_lines = [{"file": f, "line": n} for f, n in parsed.partial]
    result.unfinished = [
        {"request_id": r.request_id, "engine_request_id": r.engine_request_id, "line": r.line}
        for r in parsed.unfinished
    ]
    yield from epoch.stop()


def fold_input(cfg: Config, inp: AnalyzeInput, opts: Options) -> InputResult:
    """Read and fold one input (pure but for reading its files)."""
    result = InputResult(inp.name, inp.format)
    if inp.format == "recording":
        events = _recording_events(cfg, inp.paths[0], result)
    elif inp.format == "jsonl":
        events = _jsonl_events(inp.paths[0], result, opts)
    elif inp.format == "vllm-log":
        events = _log_events(inp, result, opts)
    else:
        raise TraceError(f"unknown input format {inp.format!r}: choose one of {', '.join(INPUT_FORMATS)}")
    # The worker's fold, not the replay's FoldProcessor: a file holds whole epochs, but its first
    # event of an epoch may be on another stream than EngineStarted (which the replay would skip).
    asm = Assembler(cfg.worker, MemoryStore())
    for event in events:
        result.events += 1
        for out in asm.apply(event):
            result.records.append((out.record_name, out.record))
    s = asm.stats
    result.fold_summary = (
        f"{s.events} events folded, {s.requests_closed} requests closed, {s.duplicates} duplicates"
    )
    for name, record in result.records:
        if name == ev.REQUEST_ACCOUNTING:
            row = {k: record.get(k) for k in ROW_FIELDS}
            modelled = result.rows_modelled.get(record["request_id"])
            row["modelled"] = ",".join(modelled) if modelled else ""
            result.rows.append(row)
        elif name == ev.USAGE_WINDOW:
            result.usage_windows += 1
        elif name == ev.DEAD_LETTER:
            result.dead_letters += 1
    return result


# --- writing ------------------------------------------------------------------------------------


def _write_table(path: Path, rows: list[dict[str, Any]], columns: list[str], fmt: str) -> None:
    if fmt == "csv":
        with path.open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.Table.from_pylist(rows, schema=None) if rows else pa.table({c: [] for c in columns}), path
    )


def _totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": len(rows)}
    for f in TOTAL_FIELDS:
        out[f] = sum(int(r.get(f) or 0) for r in rows)
    return out


def report_of(inp: AnalyzeInput, result: InputResult) -> dict[str, Any]:
    """The JSON report of one input."""
    return {
        "input": inp.name,
        "format": inp.format,
        "files": [str(p) for p in inp.paths],
        "events": result.events,
        "fold": result.fold_summary,
        "totals": _totals(result.rows),
        "usage_windows": result.usage_windows,
        "dead_letters_from_fold": result.dead_letters,
        "bad_lines": result.bad,
        "bad_line_list": result.bad_lines,
        "ignored_lines": result.ignored_lines,
        "skipped_lines": result.skipped_lines,
        "partial_lines": result.partial_lines,
        "unfinished_requests": result.unfinished,
        "requests": result.rows,
    }


@dataclass
class AnalyzeSummary:
    """The outcome of a run (also written as ``summary.<format>``)."""

    inputs: list[dict[str, Any]] = field(default_factory=list)
    totals: dict[str, Any] = field(default_factory=dict)
    duplicates: list[dict[str, Any]] = field(default_factory=list)
    failed: int = 0
    skipped: int = 0
    analysed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "inputs": self.inputs,
            "totals": self.totals,
            "duplicates": self.duplicates,
            "analysed": self.analysed,
            "skipped_finished": self.skipped,
            "failed": self.failed,
        }


class _State:
    """``analyze-state.json``: the finished inputs and their per-request rows (for the summary)."""

    def __init__(self, out: Path) -> None:
        self.path = out / STATE_FILE
        self.rows_dir = out / ".analyze-rows"
        self.data: dict[str, Any] = {"inputs": {}}
        if self.path.exists():
            try:
                self.data = json.loads(self.path.read_text())
            except ValueError:
                raise AnalyzeError(
                    f"{self.path} is not an analyze state file; remove it to start over"
                ) from None

    def finished(self, inp: AnalyzeInput, fingerprint: list[dict[str, Any]]) -> dict[str, Any] | None:
        entry = self.data["inputs"].get(inp.name)
        if entry and entry.get("files") == fingerprint and (self.rows_dir / f"{inp.name}.json").exists():
            return entry  # type: ignore[no-any-return]
        return None

    def rows(self, name: str) -> list[dict[str, Any]]:
        return json.loads((self.rows_dir / f"{name}.json").read_text())  # type: ignore[no-any-return]

    def mark(
        self,
        inp: AnalyzeInput,
        fingerprint: list[dict[str, Any]],
        line: dict[str, Any],
        rows: list[dict[str, Any]],
    ) -> None:
        self.rows_dir.mkdir(parents=True, exist_ok=True)
        (self.rows_dir / f"{inp.name}.json").write_text(json.dumps(rows))
        self.data["inputs"][inp.name] = {"files": fingerprint, "summary": line}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)  # atomic: a crash leaves the previous state


def analyze(
    cfg: Config,
    paths: list[str | Path],
    out: str | Path,
    *,
    fmt: str = "json",
    opts: Options | None = None,
    clickhouse_dsn: str | None = None,
    clickhouse_database: str | None = None,
    retries: int = 1,
    progress: Progress | None = None,
    fold: Callable[[Config, AnalyzeInput, Options], InputResult] = fold_input,
) -> AnalyzeSummary:
    """Analyse ``paths`` into ``out`` (see the module doc).

    Args:
        cfg: Worker settings of the fold (windows, bounds), ClickHouse settings of the sink.
        fmt: ``json``, ``csv`` or ``parquet``: the reports' and the summary's format.
        clickhouse_dsn: Also write the records into this store (``chdb://`` or ``http(s)://``).
        retries: Extra attempts of an input that failed.
        fold: The per-input work (injected by tests to make an input fail).

    Raises:
        AnalyzeError: bad format or output directory.
        TraceError: an input is missing or of no known format.
    """
    if fmt not in FORMATS:
        raise AnalyzeError(f"unknown report format {fmt!r}: choose json, csv or parquet")
    opts = opts or Options()
    inputs = plan(paths, opts.input_format)
    if not inputs:
        raise AnalyzeError("no inputs to analyse")
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = _State(out_dir)
    sink = None
    if clickhouse_dsn:
        from sparseety.sinks.clickhouse.writer import ClickHouseSink

        ch = {**cfg.clickhouse.model_dump(), "dsn": clickhouse_dsn}
        if clickhouse_database:
            ch["database"] = clickhouse_database
        sink = ClickHouseSink.from_config(cfg.replace(clickhouse=ch), owner="sparseety analyze")
    summary = AnalyzeSummary()
    dedup: dict[str, Counted] = {}
    all_rows: dict[str, dict[str, Any]] = {}
    dups: dict[str, dict[str, Any]] = {}
    try:
        for i, inp in enumerate(inputs):
            if progress:
                progress(i, len(inputs), inp.name)
            try:
                fingerprint = inp.fingerprint()
            except OSError as exc:  # gone or unreadable since planned: this input fails, not the run
                summary.failed += 1
                summary.inputs.append(_failed(inp, f"{type(exc).__name__}: {exc}", 0))
                continue
            done = state.finished(inp, fingerprint)
            if done is not None:
                rows = state.rows(inp.name)
                summary.skipped += 1
                summary.inputs.append({**done["summary"], "status": "skipped (finished earlier)"})
                _count(rows, dedup, all_rows, dups)
                continue
            result, error = None, ""
            for _attempt in range(retries + 1):
                try:
                    result = fold(cfg, inp, opts)
                    break
                except Exception as exc:  # one input's failure must not stop the others
                    error = f"{type(exc).__name__}: {exc}"
            if result is None:
                summary.failed += 1
                summary.inputs.append(_failed(inp, error, retries + 1))
                continue
            report = report_of(inp, result)
            if fmt == "json":
                (out_dir / f"{inp.name}.json").write_text(json.dumps(report, indent=1) + "\n")
            else:
                _write_table(out_dir / f"{inp.name}.{fmt}", result.rows, [*ROW_FIELDS, "modelled"], fmt)
                meta = {k: v for k, v in report.items() if k != "requests"}
                (out_dir / f"{inp.name}.meta.json").write_text(json.dumps(meta, indent=1) + "\n")
            _count(result.rows, dedup, all_rows, dups)
            if sink is not None:
                topic = f"analyze:{inp.name}"
                try:
                    # A duplicate (a log's copy of a plugin-accounted request) is written too: the
                    # store's views hide it and net it out of the log's usage windows, which
                    # include it (migration 008_log_dedup), so the store counts it once as here.
                    for offset, (name, record) in enumerate(result.records):
                        if sink.accepts(name):
                            sink.add(name, record, topic=topic, partition=0, offset=offset)
                    sink.flush()  # retried inside the sink (sink.max_retries)
                except SparseetyError as exc:
                    sink.discard(topic, 0)
                    for row in result.rows:  # not in this run's totals (dedup keeps its claim)
                        all_rows.pop(row["request_uid"], None)
                        dups.pop(row["request_uid"], None)
                    summary.failed += 1
                    summary.inputs.append(_failed(inp, f"writing to ClickHouse: {exc}", 1))
                    continue  # not finished: the next run writes it again (the tables are idempotent)
            line = {
                "input": inp.name,
                "format": inp.format,
                "status": "analysed",
                "bad_lines": result.bad,
                "unfinished": len(result.unfinished),
                **_totals(result.rows),
            }
            state.mark(inp, fingerprint, line, result.rows)
            summary.analysed += 1
            summary.inputs.append(line)
        if progress:
            progress(len(inputs), len(inputs), "")
    finally:
        if sink is not None:
            sink.close()
    summary.duplicates = list(dups.values())
    summary.totals = _totals([r for uid, r in all_rows.items() if uid not in dups])
    _write_summary(out_dir, summary, fmt)
    return summary


def _failed(inp: AnalyzeInput, error: str, attempts: int) -> dict[str, Any]:
    return {"input": inp.name, "format": inp.format, "status": "failed", "error": error, "attempts": attempts}


def _count(
    rows: list[dict[str, Any]],
    dedup: dict[str, Counted],
    all_rows: dict[str, dict[str, Any]],
    dups: dict[str, dict[str, Any]],
) -> set[str]:
    """Fold the rows into the dedup state (``dups``: uid -> why it is not counted); return the
    uids of these rows that are duplicates."""
    mine = set()
    for row in rows:
        all_rows[row["request_uid"]] = row
        key = dedup_key(row)
        dedup[key], decisions = dedup_step(dedup.get(key), row)
        for uid, counted, dup_of in decisions:
            if counted:
                dups.pop(uid, None)
            else:
                dups[uid] = {"request_uid": uid, "duplicate_of": dup_of, "request_id": row["request_id"]}
                mine.add(uid)
    return mine & {r["request_uid"] for r in rows}


def _write_summary(out_dir: Path, summary: AnalyzeSummary, fmt: str) -> None:
    data = summary.to_dict()
    if fmt == "json":
        (out_dir / "summary.json").write_text(json.dumps(data, indent=1) + "\n")
        return
    cols = ["input", "format", "status", "error", "bad_lines", "unfinished", "requests", *TOTAL_FIELDS]
    rows = [dict(r) for r in summary.inputs] + [
        {"input": "(total, each request once)", "status": "", **summary.totals}
    ]
    _write_table(out_dir / f"summary.{fmt}", [{c: r.get(c) for c in cols} for r in rows], cols, fmt)
    (out_dir / "summary.meta.json").write_text(
        json.dumps({k: v for k, v in data.items() if k != "inputs"}, indent=1) + "\n"
    )
