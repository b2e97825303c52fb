"""Where a request's think section ends, as the engine's own reasoning parser splits it.

vLLM runs a reasoning parser (``--reasoning-parser``: ``structured_outputs_config.reasoning_parser``)
in the front end, to fill ``reasoning_content``, and the engine core keeps its class beside the
tokenizer in the ``StructuredOutputManager`` (for structured output after the think section).
The producer builds one instance from that class and that tokenizer, so the split is vLLM's own,
and asks it once per request, on the emitter thread, when the request is freed:
``extract_content_ids(output)`` is the answer, so the think section (delimiters included) is
the ``len(output) - len(answer)`` positions before it. vLLM does not count them itself
(``completion_tokens_details.reasoning_tokens`` stays empty, vllm-project/vllm #50895).

An engine without a parser reports ``None`` (not observed), never 0.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class ReasoningSplit:
    """The engine's reasoning parser, or nothing.

    Args:
        name: The parser's registered name (``deepseek_r1``, ...); None without one.
        parser: An instance of the engine's parser class; None without one.
    """

    def __init__(self, name: str | None, parser: Any) -> None:
        self.name = name if parser is not None else None
        self.parser = parser

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
            log.warning(
                "sparseety: reasoning parser %s unusable (%s): reasoning tokens not observed", name, exc
            )
            return cls(None, None)
        return cls(str(name), parser)

    def reasoning_end(self, req: Any) -> int | None:
        """Output positions ``[0, end)`` of a freed ``Request`` are the think section; None
        without a parser."""
        if self.parser is None:
            return None
        ids = list(req.output_token_ids or ())
        try:
            answer = self.parser.extract_content_ids(ids)
        except Exception:  # the engine must not fail because of us: this request is not observed
            log.debug("sparseety: reasoning parser failed on one request", exc_info=True)
            return None
        return max(0, len(ids) - len(answer or ()))
