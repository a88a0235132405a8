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
from engine.text.tool_parsers.forced import NamedToolParser, RequiredToolParser
from engine.text.tool_parsers.hermes import HermesToolParser
from engine.text.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}

__all__ = ["TOOL_PARSERS", "HermesToolParser", "Llama3JsonToolParser", "NamedToolParser", "ParsedCall",
           "ParsedOutput", "RequiredToolParser", "StreamDelta", "ToolCallDelta", "ToolCallStream", "ToolParser"]
