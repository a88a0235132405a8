"""A request's reasoning: whether its output starts inside the model's thinking, how each sequence's text is split,
and what the engine is told.

vLLM's behaviour with ``--reasoning-parser``, for chat: the output is split into ``reasoning_content`` and the
answer; tool calls are parsed from the answer alone; a guided constraint (response_format, a forced tool call)
applies only after the thinking, the engine starting its grammar after the end tag's token; and
``thinking_token_budget`` closes the thinking once spent (the engine forces that token). The tags must be single
tokens of the vocabulary, not special ones (which skip_special_tokens would drop from the text), as Qwen3 and
DeepSeek-R1 ship them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from common.errors import InvalidRequestError
from engine.text import Tokenizer
from engine.text.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningStream, prompt_ends_thinking
from proto.sluice.v1 import engine_pb2, generation_pb2


@dataclass(frozen=True)
class Reasoning:
    """The service's reasoning parser (``--reasoning-parser``) and its tags' token ids."""

    parser: ReasoningParser
    start_token_id: int
    end_token_id: int

    @classmethod
    def load(cls, name: str, tokenizer: Tokenizer) -> Reasoning:
        """ValueError naming the flag when ``name`` is not a parser, or its tags are not plain tokens of the
        vocabulary."""
        if name not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser {name!r}: expected one of {', '.join(sorted(REASONING_PARSERS))}")
        parser = REASONING_PARSERS[name]()
        ids = []
        for tag in (parser.start_tag, parser.end_tag):
            token_id = tokenizer.backend.token_to_id(tag)
            if token_id is None or token_id in tokenizer.all_special_ids:
                raise ValueError(f"--reasoning-parser {name}: the model's vocabulary has no token {tag!r}"
                                 if token_id is None else
                                 f"--reasoning-parser {name}: the model's tokenizer marks {tag!r} special, so the "
                                 "text would lose it")
            ids.append(token_id)
        return cls(parser, ids[0], ids[1])


@dataclass(frozen=True)
class ReasoningPlan:
    """``parser`` splits each sequence's output (None: it is all answer); ``thinking``: it starts inside the
    thinking block; ``engine``: what the engine request carries (None: nothing for the engine to do)."""

    parser: ReasoningParser | None = None
    thinking: bool = False
    engine: engine_pb2.EngineReasoning | None = None

    def stream(self) -> ReasoningStream | None:
        return self.parser.stream(self.thinking) if self.parser is not None else None


def plan_reasoning(request: generation_pb2.GenerateRequest, reasoning: Reasoning | None,
                   prompt_ids: list[int] | np.ndarray, *, constrained: bool) -> ReasoningPlan:
    """``prompt_ids``: the rendered prompt's (its chat_template_kwargs already checked); ``constrained``: the
    engine request carries a guided constraint."""
    budget = request.thinking_token_budget if request.HasField("thinking_token_budget") else None
    if request.WhichOneof("input") != "chat":
        if budget is not None:
            raise InvalidRequestError("thinking_token_budget", "needs chat input (messages)")
        return ReasoningPlan()
    if reasoning is None:
        if budget is not None:
            raise InvalidRequestError("thinking_token_budget", "needs the service started with --reasoning-parser")
        return ReasoningPlan()
    kwargs = json.loads(request.chat.chat_template_kwargs) if request.chat.chat_template_kwargs else {}
    closed = prompt_ends_thinking(prompt_ids, reasoning.start_token_id, reasoning.end_token_id)
    thinking = reasoning.parser.thinking_at_start(closed, kwargs)
    engine = None
    if thinking and (constrained or budget is not None):
        engine = engine_pb2.EngineReasoning(end_token_id=reasoning.end_token_id)
        if budget is not None:
            engine.thinking_token_budget = budget
    return ReasoningPlan(reasoning.parser, thinking, engine)
