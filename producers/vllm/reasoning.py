"""Which output positions are reasoning, as the engine's own reasoning parser splits them.

vLLM runs a reasoning parser (``--reasoning-parser``: ``structured_outputs_config.reasoning_parser``)
in the front end, to fill ``reasoning_content`` and ``completion_tokens_details.reasoning_tokens``
(``count_reasoning_tokens``), and the engine core loads its class beside the tokenizer in the
``StructuredOutputManager`` (structured output after the think section). The producer builds one
instance from that class and that tokenizer, so the split is vLLM's own, and reads it once per
request, on the emitter thread, when the request is freed: the positions strictly inside the
parser's think delimiters (``start_token_id`` .. ``end_token_id``, nesting counted, as vLLM's
``BaseThinkingReasoningParser.count_reasoning_tokens`` counts them), as ``[start, end)`` spans.
Each split is checked against the parser's own ``count_reasoning_tokens``; a parser without
delimiter tokens (or one that counts otherwise) is reported once and not observed.

An engine without a parser reports ``None`` (not observed), never an empty split.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def think_spans(ids: list[int], start: int, end: int) -> list[int]:
    """Flat ``[start, end)`` pairs of the positions inside ``start`` .. ``end`` delimiters, the
    delimiters excluded (nesting counted; a stray end ignored; an open section runs to the end)."""
    spans: list[int] = []
    depth = 0
    for i, t in enumerate(ids):
        if t == start:
            depth += 1
            inside = False
        elif t == end:
            depth = max(0, depth - 1)
            inside = False
        else:
            inside = depth > 0
        if inside and (not spans or spans[-1] != i):
            spans += [i, i + 1]
        elif inside:
            spans[-1] = i + 1
    return spans


class ReasoningSplit:
    """The engine's reasoning parser, or nothing.

    Args:
        name: The parser's registered name (``deepseek_r1``, ...); None without one.
        parser: An instance of the engine's parser class; None without one.
    """

    def __init__(self, name: str | None, parser: Any) -> None:
        start = getattr(parser, "start_token_id", None)
        end = getattr(parser, "end_token_id", None)
        self.delimiters = (start, end) if isinstance(start, int) and isinstance(end, int) else None
        if parser is not None and self.delimiters is None:
            log.warning("sparseety: reasoning parser %s has no think tokens: reasoning not observed", name)
        self.name = name if self.delimiters is not None else None
        self.parser = parser if self.delimiters is not None else None
        self._disagreed = False

    @classmethod
    def of_scheduler(cls, scheduler: Any) -> ReasoningSplit:
        """The parser vLLM's engine core loaded for ``scheduler`` (its structured-output manager)."""
        vllm_config = getattr(scheduler, "vllm_config", None)
        so_config = getattr(vllm_config, "structured_outputs_config", None)
        name = getattr(so_config, "reasoning_parser", None) or None
        manager = getattr(scheduler, "structured_output_manager", None)
        parser_cls = getattr(manager, "reasoner_cls", None)
        tokenizer = getattr(manager, "tokenizer", None)
        if not name or parser_cls is None or tokenizer is None:
            return cls(None, None)
        try:
            parser = parser_cls(tokenizer=tokenizer)
        except Exception as exc:  # a parser that cannot run here: reasoning not observed
            log.warning("sparseety: reasoning parser %s unusable (%s): reasoning not observed", name, exc)
            return cls(None, None)
        return cls(str(name), parser)

    def spans(self, req: Any) -> list[int] | None:
        """The reasoning spans of a freed ``Request``'s output; None when not observed."""
        if self.parser is None or self.delimiters is None:
            return None
        ids = list(req.output_token_ids or ())
        spans = think_spans(ids, *self.delimiters)
        try:
            count = self.parser.count_reasoning_tokens(ids)
        except Exception:  # the engine must not fail because of us: this request is not observed
            log.debug("sparseety: reasoning parser failed on one request", exc_info=True)
            return None
        if count != sum(b - a for a, b in zip(spans[::2], spans[1::2], strict=True)):
            if not self._disagreed:
                self._disagreed = True
                log.warning("sparseety: reasoning parser %s counts otherwise: not observed", self.name)
            return None
        return spans
