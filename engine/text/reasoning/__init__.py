"""Reasoning parsing of a model's text output (text level: the engine never sees it): its thinking apart from
its answer, as vLLM's ``--reasoning-parser`` does.

``REASONING_PARSERS`` maps vLLM's parser names to parsers.
"""

from __future__ import annotations

from engine.text.reasoning.base import ReasoningOutput, ReasoningParser, ReasoningStream, prompt_ends_thinking
from engine.text.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from engine.text.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}

__all__ = ["REASONING_PARSERS", "DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "ReasoningOutput",
           "ReasoningParser", "ReasoningStream", "prompt_ends_thinking"]
