"""DeepSeek-R1 (and its distills, QwQ): ``<think>`` ... ``</think>`` then the answer.

The templates of R1-0528 and later write ``<think>\\n`` into the prompt, so the model writes only the end tag;
the first R1 writes both, or sometimes starts thinking without the start tag. All three read the same: the
output thinks until ``</think>`` (vLLM's ``deepseek_r1``). R1 has no switch for thinking: only a template that
closes the block in the prompt turns it off.
"""

from __future__ import annotations

from engine.text.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
