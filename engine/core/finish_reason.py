"""Why a sequence ended: the vocabulary that requests, beam search and the engine's outputs share."""

from __future__ import annotations

import enum


class FinishReason(enum.Enum):
    """Why a sequence ended. Text-level reasons (stop strings) live outside the core."""

    EOS = "eos"              # the model's end-of-sequence token
    STOP = "stop"            # one of ``stop_token_ids``
    LENGTH = "length"        # max_tokens or max_model_len reached
    ABORT = "abort"          # cancelled by the caller
    ERROR = "error"          # the engine failed while running it
