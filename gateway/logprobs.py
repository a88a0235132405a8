"""Log probabilities in the three shapes clients read: OpenAI chat, OpenAI's legacy
completions lists (with echo, the prompt's tokens first), and vLLM's prompt_logprobs."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.backend import PromptTokenLogprob, TokenLogprob


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, object]:
    return {"content": [
        {"token": e.text, "logprob": e.logprob, "bytes": list(e.text_bytes),
         "top_logprobs": [{"token": t.text, "logprob": t.logprob, "bytes": list(t.text_bytes)} for t in e.top]}
        for e in entries
    ]}


def completion_logprobs(entries: Sequence[TokenLogprob], text_offset: int,
                        prompt: Sequence[PromptTokenLogprob] = ()) -> dict[str, object]:
    """Parallel lists; ``top_logprobs`` maps text to logprob. Echoed prompt tokens come first, the
    first of them with ``null`` (nothing precedes it), as OpenAI and vLLM write them."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for p in prompt:
        tokens.append(p.text)
        token_logprobs.append(p.logprob)
        top_logprobs.append(None if p.logprob is None else {p.text: p.logprob, **{t.text: t.logprob for t in p.top}})
        offsets.append(text_offset)
        text_offset += len(p.text)
    for e in entries:
        tokens.append(e.text)
        token_logprobs.append(e.logprob)
        top_logprobs.append({e.text: e.logprob, **{t.text: t.logprob for t in e.top}})
        offsets.append(text_offset)
        text_offset += len(e.text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def vllm_prompt_logprobs(prompt: Sequence[PromptTokenLogprob]) -> list[dict[str, dict[str, object]] | None]:
    """vLLM's ``prompt_logprobs``: ``null`` for the first token, then per position
    ``{token_id: {"logprob", "rank", "decoded_token"}}`` for the prompt token and its likeliest
    alternatives (ranks from 1). The backend does not say the prompt token's rank: it is its place
    among the alternatives, or one past them when it is not one of them."""
    out: list[dict[str, dict[str, object]] | None] = []
    for p in prompt:
        if p.logprob is None:
            out.append(None)
            continue
        ranks = {t.token_id: rank for rank, t in enumerate(p.top, start=1)}
        position: dict[str, dict[str, object]] = {
            str(p.token_id): {"logprob": p.logprob, "rank": ranks.get(p.token_id, len(p.top) + 1),
                              "decoded_token": p.text}}
        for rank, t in enumerate(p.top, start=1):
            position.setdefault(str(t.token_id), {"logprob": t.logprob, "rank": rank, "decoded_token": t.text})
        out.append(position)
    return out
