"""Text around the engine: tokenizer, chat templates, incremental detokenizer (a leaf library)."""

from __future__ import annotations

from engine.text.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from engine.text.tokenizer import Tokenizer

__all__ = ["DetokenizerDelta", "IncrementalDetokenizer", "Tokenizer"]
