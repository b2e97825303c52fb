"""Collect jobs: what ``POST /api/v1/collect`` accepts and what each kind of job does.

* ``replay``: re-read a topic range through its processor (:class:`~sparseety.sinks.replay.Replay`)
  into the store this process owns, with a sink of its own on that store (the tables are
  idempotent, so it may overlap what the live sink writes).
* ``ingest``: publish a trace file (on this machine) to the engine-events topic
  (:func:`~sparseety.producers.logs.ingest.ingest`); the assembler folds it like a live engine,
  or a replay job of the engine-events topic folds it into the store.
* ``analyze``: fold trace files offline into per-input reports and a summary in a directory on
  this machine (:func:`~sparseety.offline.analyze.analyze`, as ``sparseety analyze``); nothing is
  published and the store is not written (``sparseety analyze --clickhouse`` does that).

Specs are checked when submitted (bounds, processor, file), so a bad one is a 400, not a failed job.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sparseety.config import Config
from sparseety.errors import SparseetyError
from sparseety.sinks.clickhouse.client import Store

#: The collect job kinds, as a body's ``kind`` names them.
COLLECT_KINDS = ("replay", "ingest", "analyze", "vllm_log")
#: The formats of a ``vllm_log`` job's report file (``output_format``).
LOG_OUTPUT_FORMATS = ("json", "csv", "parquet")
#: Where a ``vllm_log`` job writes its report when the spec names no ``output_path``.
COLLECT_DIR = "collect"
#: The columns of a ``vllm_log`` job's report: one row per request it published.
LOG_REPORT_COLUMNS = (
    "request_id",
    "engine_request_id",
    "tenant",
    "model",
    "arrival_ts_ns",
    "finished_ts_ns",
    "prompt_tokens",
    "output_tokens",
    "finish_reason",
    "streamed",
    "modelled",
)


class CollectSpecError(SparseetyError):
    """A collect request that cannot run as asked (answered with 400)."""


class ReplaySpec(BaseModel):
    """Replay a topic range into the store."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    kind: Literal["replay"]
    topic: str = Field(description="timelines, usage, dlq, engine-events, or a full topic name.")
    start: str = Field(
        "beginning", alias="from", description="Offset, ISO-8601 time, duration ago (2h) or beginning."
    )
    stop: str = Field(
        "end", alias="to", description="Offset, ISO-8601 time, duration ago or end (exclusive)."
    )
    partitions: list[int] = Field(default_factory=list, description="Only these partitions (default all).")
    processor: str | None = Field(None, description="Registered processor (default: the topic's).")
    idle_s: float = Field(1.0, gt=0, le=60, description="Quiet seconds that end a partition.")


class IngestSpec(BaseModel):
    """Publish a trace file to the engine-events topic."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["ingest"]
    path: str = Field(description="Trace file on the API's machine.")
    format: Literal["auto", "recording", "jsonl"] = "auto"
    engine: str | None = Field(None, description="Engine name of a JSONL trace (default trace-<stem>).")
    tenant: str = Field("", description="Tenant of JSONL lines that name none.")
    model: str = Field("", description="Model of JSONL lines that name none.")
    strict: bool = Field(False, description="Publish nothing if any line is bad.")


class AnalyzeSpec(BaseModel):
    """Fold trace files offline into reports (``sparseety analyze``)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["analyze"]
    inputs: list[str] = Field(min_length=1, description="Trace files on the API's machine.")
    out: str = Field(description="Report directory on the API's machine (a rerun skips finished inputs).")
    format: Literal["json", "csv", "parquet"] = Field("json", description="Reports' format.")
    input_format: Literal["auto", "recording", "jsonl", "vllm-log"] = "auto"
    tenant: str = Field("", description="Tenant of requests whose trace names none.")
    model: str = Field("", description="Model of requests whose trace names none.")
    retries: int = Field(1, ge=0, le=5, description="Extra attempts of an input that failed.")


class LogFilters(BaseModel):
    """Which logged requests a ``vllm_log`` collect publishes (null: all)."""

    model_config = ConfigDict(extra="forbid")

    request_id: str | None = Field(None, description="Only this request (the client's or the engine's id).")
    model_name: str | None = Field(None, description="Only requests of this served model.")


class VllmLogSpec(BaseModel):
    """The seed's body: parse a vLLM server log into request events (``trace_source: vllm_log``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    trace_source: Literal["vllm_log"] | None = Field(None, description="The seed's name of the kind.")
    kind_: Literal["vllm_log"] | None = Field(None, alias="kind", description="Or kind, as the other jobs.")
    log_path: str = Field(description="The server log on the API's machine (rotated: the newest segment).")
    output_format: Literal["json", "csv", "parquet"] = Field(
        "json", description="The format of the report file: one row per request published."
    )
    output_path: str | None = Field(
        None,
        description="The report file on the API's machine (default <data_dir>/collect/<job id>.<format>).",
    )
    window_seconds: float | None = Field(
        None, gt=0, description="Only requests that finished this close to the log's last one."
    )
    filters: LogFilters = Field(default_factory=LogFilters)
    tenant: str = Field("", description="Tenant of the logged requests (a log names none).")
    model: str = Field("", description="Model when the log names no served model.")

    @model_validator(mode="after")
    def _named(self) -> VllmLogSpec:
        if self.trace_source is None and self.kind_ is None:
            raise ValueError('name the job: "kind": "vllm_log" (or the seed\'s "trace_source": "vllm_log")')
        return self

    @property
    def kind(self) -> str:
        return "vllm_log"


class ReplayJob:
    """A checked replay spec, ready to run on a job thread."""

    def __init__(self, cfg: Config, store: Store, spec: ReplaySpec) -> None:
        from sparseety.sinks.processors import load_processor, processor_for_topic
        from sparseety.sinks.replay import parse_bound

        self.cfg, self.store, self.spec = cfg, store, spec
        self.topic = cfg.topics.resolve(spec.topic)
        now = time.time_ns()
        self.lo, self.hi = parse_bound(spec.start, now_ns=now), parse_bound(spec.stop, now_ns=now)
        if self.lo.kind == "end" or self.hi.kind == "beginning":
            raise CollectSpecError(f"empty replay range [{spec.start}, {spec.stop})")
        self.processor = (
            load_processor(spec.processor, cfg) if spec.processor else processor_for_topic(cfg, self.topic)
        )

    def params(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "from": str(self.lo),
            "to": str(self.hi),
            "partitions": self.spec.partitions,
        }

    def __call__(self, ctx: Any) -> dict[str, Any]:
        from sparseety.sinks.clickhouse.writer import ClickHouseSink
        from sparseety.sinks.replay import Replay

        sink = ClickHouseSink(
            self.store,
            batch_max_rows=self.cfg.sink.batch_max_rows,
            max_retries=self.cfg.sink.max_retries,
            retry_backoff_s=self.cfg.sink.retry_backoff_s,
        )
        try:
            report = Replay(
                self.cfg,
                self.topic,
                self.lo,
                self.hi,
                sink,
                self.processor,
                partitions=self.spec.partitions or None,
                idle_s=self.spec.idle_s,
                progress=ctx.progress,
            ).run()
        finally:
            sink.close()
        ctx.progress(report.records_in_range, report.records_in_range)
        return {
            "topic": report.topic,
            "records_read": report.records_read,
            "records_in_range": report.records_in_range,
            "records_out": report.records_out,
            "rows_written": dict(report.written.rows),
            "undecodable": len(report.undecodable),
            "rejected": report.rejected,
            "seconds": round(report.seconds, 3),
            "records_per_s": round(report.records_per_s, 1),
            "rows_per_s": round(report.rows_per_s, 1),
            "summary": report.processor_summary,
        }


class IngestJob:
    """A checked ingest spec, ready to run on a job thread."""

    def __init__(self, cfg: Config, spec: IngestSpec) -> None:
        self.cfg, self.spec = cfg, spec
        self.path = Path(spec.path).expanduser()
        if not self.path.is_file():
            raise CollectSpecError(f"no trace file at {spec.path} on the API's machine", path=spec.path)

    def params(self) -> dict[str, Any]:
        return {"path": str(self.path), "format": self.spec.format, "strict": self.spec.strict}

    def __call__(self, ctx: Any) -> dict[str, Any]:
        from sparseety.producers.logs.ingest import ingest

        report = ingest(
            self.cfg,
            self.path,
            fmt=self.spec.format,
            engine_name=self.spec.engine,
            default_tenant=self.spec.tenant,
            default_model=self.spec.model,
            strict=self.spec.strict,
            progress=ctx.progress,
        )
        return report.to_dict()


class VllmLogJob:
    """A checked ``vllm_log`` spec: its segments (``<log>.1``, ``<log>.2``, ... beside it) are
    read oldest first and the selected requests published to engine-events (the assembler folds
    them as request-level requests, ``engine_kind = vllm_log``).

    A request the store already holds from a step-level source (the plugin: same engine request
    id, :mod:`sparseety.offline.source_dedup`) is not published: the store's views would hide it
    (migration 008_log_dedup), so publishing it would only store a row no answer reads.
    """

    def __init__(self, cfg: Config, store: Store, spec: VllmLogSpec) -> None:
        self.cfg, self.store, self.spec = cfg, store, spec
        self.path = Path(spec.log_path).expanduser()
        if not self.path.is_file():
            raise CollectSpecError(f"no log file at {spec.log_path} on the API's machine", path=spec.log_path)
        self.segments = sorted(
            p for p in self.path.parent.glob(self.path.name + ".*") if p.suffix[1:].isdigit()
        )

    def params(self) -> dict[str, Any]:
        return {
            "log_path": str(self.path),
            "segments": [str(p) for p in self.segments],
            "window_seconds": self.spec.window_seconds,
            "filters": self.spec.filters.model_dump(),
            "output_format": self.spec.output_format,
        }

    def output_path(self, job_id: str) -> Path:
        """Where the report goes: ``output_path``, else ``<data_dir>/collect/<job id>.<format>``."""
        if self.spec.output_path:
            return Path(self.spec.output_path).expanduser()
        return self.cfg.data_path / COLLECT_DIR / f"{job_id}.{self.spec.output_format}"

    def __call__(self, ctx: Any) -> dict[str, Any]:
        from sparseety.offline.source_dedup import REQUEST_LEVEL_KINDS
        from sparseety.producers.logs.ingest import ingest
        from sparseety.producers.logs.vllm_log import VllmLogParser, read_log, rotation_order

        f = self.spec.filters
        default_model = self.spec.model
        segments = rotation_order([*self.segments, self.path])
        parser = VllmLogParser(year=2000)  # only the ids are wanted here
        ids = [
            r.engine_request_id
            for r in read_log(segments, parser, lambda _p, _e: None)
            if r.engine_request_id
        ]
        accounted = {
            r["request_id"]
            for r in self.store.query(
                f"SELECT DISTINCT request_id FROM {self.store.table('requests')} "
                "WHERE has({ids:Array(String)}, request_id) AND NOT has({kinds:Array(String)}, engine_kind)",
                {"ids": ids, "kinds": sorted(REQUEST_LEVEL_KINDS)},
            )
        }
        skipped: list[str] = []

        def select(req: Any) -> bool:
            if f.request_id is not None and f.request_id not in (req.request_id, req.engine_request_id):
                return False
            if f.model_name is not None and f.model_name != (req.model or default_model):
                return False
            if req.engine_request_id in accounted:
                skipped.append(req.engine_request_id)
                return False
            return True

        published: list[dict[str, Any]] = []
        report = ingest(
            self.cfg,
            self.path,
            fmt="vllm-log",
            default_tenant=self.spec.tenant,
            default_model=default_model,
            progress=ctx.progress,
            segments=list(self.segments),
            log_select=select,
            log_window_s=self.spec.window_seconds,
            log_published=lambda req: published.append(log_report_row(req, self.spec.tenant, default_model)),
        )
        out = self.output_path(ctx.job.id)
        write_report(out, published, self.spec.output_format)
        return {
            **report.to_dict(),
            "already_accounted": len(skipped),
            "output": str(out),
            "output_format": self.spec.output_format,
            "output_rows": len(published),
        }


def log_report_row(req: Any, tenant: str, default_model: str) -> dict[str, Any]:
    """One row of a ``vllm_log`` job's report (:data:`LOG_REPORT_COLUMNS`): a published request
    as the log tells it; ``modelled`` names the accounting columns the log does not observe."""
    return {
        "request_id": req.request_id,
        "engine_request_id": req.engine_request_id,
        "tenant": tenant,
        "model": req.model or default_model or "vllm-log",
        "arrival_ts_ns": req.arrival_ns,
        "finished_ts_ns": max(req.finished_ns, req.arrival_ns),
        "prompt_tokens": req.prompt_tokens,
        "output_tokens": req.output_tokens,
        "finish_reason": req.finish_reason or "unknown",
        "streamed": req.streamed,
        "modelled": ",".join(sorted(req.modelled)),
    }


def write_report(path: Path, rows: list[dict[str, Any]], fmt: str) -> None:
    """Write a job's report rows as JSON (an array of objects), CSV or Parquet.

    Raises:
        CollectSpecError: the file cannot be written.
    """
    import json

    from sparseety.queries.export import rows_file

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if fmt == "json":
            path.write_text(json.dumps(rows, indent=1) + "\n")
        elif rows:
            path.write_bytes(rows_file(rows, fmt))
        elif fmt == "csv":  # no request: the header alone
            path.write_text(",".join(LOG_REPORT_COLUMNS) + "\n")
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({c: pa.array([], pa.string()) for c in LOG_REPORT_COLUMNS}), path)
    except OSError as exc:
        reason = exc.strerror or exc
        raise CollectSpecError(f"cannot write the report {path}: {reason}", path=str(path)) from None


class AnalyzeJob:
    """A checked analyze spec: every input exists before the job is queued."""

    def __init__(self, cfg: Config, spec: AnalyzeSpec) -> None:
        self.cfg, self.spec = cfg, spec
        missing = [p for p in spec.inputs if not Path(p).expanduser().is_file()]
        if missing:
            raise CollectSpecError(
                f"no trace file at {', '.join(missing)} on the API's machine", path=missing[0]
            )
        self.out = Path(spec.out).expanduser()

    def params(self) -> dict[str, Any]:
        return {"inputs": self.spec.inputs, "out": str(self.out), "format": self.spec.format}

    def __call__(self, ctx: Any) -> dict[str, Any]:
        from sparseety.offline.analyze import Options, analyze

        summary = analyze(
            self.cfg,
            [Path(p).expanduser() for p in self.spec.inputs],
            self.out,
            fmt=self.spec.format,
            opts=Options(self.spec.input_format, self.spec.tenant, self.spec.model),
            retries=self.spec.retries,
            progress=lambda done, total, _name: ctx.progress(done, total),
        )
        return {"out": str(self.out), **summary.to_dict()}
