"""Tool-call parsing of a model's text output (text level: the engine never sees it).

``TOOL_PARSERS`` maps vLLM's ``--tool-call-parser`` names to parsers; ``RequiredToolParser`` and
``NamedToolParser`` read back outputs that tool_choice "required" or a named function constrained.
"""

from __future__ import annotations

from engine.text.tool_parsers.base import (
    ParsedCall,
    ParsedOutput,
    StreamDelta,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
)
from engine.text.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from engine.text.tool_parsers.forced import NamedToolParser, RequiredToolParser
from engine.text.tool_parsers.hermes import HermesToolParser
from engine.text.tool_parsers.llama3_json import Llama3JsonToolParser
from engine.text.tool_parsers.mistral import MistralToolParser
from engine.text.tool_parsers.pythonic import PythonicToolParser
from engine.text.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV3ToolParser,  # V3.1's layout: the same parser reads both
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
}

__all__ = ["TOOL_PARSERS", "DeepSeekV3ToolParser", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser",
           "NamedToolParser", "ParsedCall", "ParsedOutput", "PythonicToolParser", "Qwen3CoderToolParser",
           "RequiredToolParser", "StreamDelta", "ToolCallDelta", "ToolCallStream", "ToolParser"]
