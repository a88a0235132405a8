"""Qwen3 (and Qwen3.5): ``<think>`` ... ``</think>`` then the answer.

Qwen3 up to the 2507 release writes its own ``<think>``; the Thinking-2507 models and Qwen3.5 have it in the
prompt and write only ``</think>``: both think until the end tag (vLLM's ``qwen3``). The chat template's
``enable_thinking`` switch (chat_template_kwargs, default true) turns thinking off: the template then closes an
empty block in the prompt, and the whole output is the answer, even from a template that ignores the switch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.text.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def thinking_at_start(self, prompt_ends_thinking: bool, template_kwargs: Mapping[str, Any]) -> bool:
        return not prompt_ends_thinking and template_kwargs.get("enable_thinking", True) is not False
