"""Errors of the trace ingest."""

from __future__ import annotations

from sparseety.errors import SparseetyError


class TraceError(SparseetyError):
    """A trace file cannot be ingested (unreadable, unknown format, delivery failed)."""


class BadTraceLineError(TraceError):
    """One line (JSONL) or record (recording) of a trace is invalid.

    Attributes:
        line: 1-based line number (JSONL) or record number (recording).
        reason: What is wrong, without the line's content (it may hold prompts or secrets).
        raw: The line's or record's bytes, for the dead-letter topic (None where not framed).
    """

    def __init__(self, line: int, reason: str, *, raw: bytes | None = None, **fields: object) -> None:
        super().__init__(f"line {line}: {reason}", line=line, reason=reason, **fields)
        self.line = line
        self.reason = reason
        self.raw = raw
