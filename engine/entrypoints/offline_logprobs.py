"""The engine's logprobs in the offline API's shapes, as vLLM's ``LogprobsProcessor`` builds them.

A generated token's entry is ``{sampled token: Logprob, top token: Logprob, ...}``: the sampled token first with
its rank in the whole distribution, then the ``logprobs`` most likely tokens with ranks 1..k (a sampled token
among them keeps its first place in the dict). A prompt's list is None for its first token, then the same dict
per token with the prompt's own token first. ``decoded_token`` is the token's text decoded alone, special tokens
kept (vLLM decodes each id by itself with the tokenizer's defaults).
"""

from __future__ import annotations

from collections.abc import Callable

from engine.core.outputs import Logprob, PromptLogprobDicts
from engine.core.request import PromptLogprobs

Decode = Callable[[int], str]


def token_logprobs(token_id: int, logprob: float, rank: int | None, top: dict[int, float],
                   decode: Decode) -> dict[int, Logprob]:
    """One position's dict: ``token_id`` (sampled, or the prompt's) first, then the top tokens, most likely
    first."""
    entry = {token_id: Logprob(logprob, rank, decode(token_id))}
    for top_rank, (tid, value) in enumerate(top.items(), start=1):
        entry[tid] = Logprob(value, top_rank, decode(tid))
    return entry


def prompt_logprob_dicts(plp: PromptLogprobs, decode: Decode) -> PromptLogprobDicts:
    """vLLM's ``RequestOutput.prompt_logprobs`` for the engine's prompt logprobs."""
    result: PromptLogprobDicts = [None]
    ranks: list[int | None] = plp.ranks.tolist() if plp.ranks is not None else [None] * len(plp.logprobs)
    for token_id, lp, rank, ids, lps in zip(plp.token_ids[1:].tolist(), plp.logprobs.tolist(), ranks,
                                            plp.top_ids.tolist(), plp.top_logprobs.tolist()):
        result.append(token_logprobs(token_id, lp, rank, dict(zip(ids, lps)), decode))
    return result
