"""Start-up check of speculative decoding's draft model against the target's tokenizer (text lives here, at the
edge: the worker compares vocabulary sizes, only an entry point can read tokenizers)."""
from __future__ import annotations

from common.errors import InvalidRequestError
from engine.config import EngineConfig
from engine.text.tokenizer import Tokenizer


def check_draft_tokenizer(config: EngineConfig, target: Tokenizer) -> None:
    """Refuse a draft model whose tokenizer is not the target's: the same token strings under the same ids and
    the same special tokens. Its proposals are ids the target reads as its own; another tokenizer's ids would be
    rejected nearly always (no speedup), or mean other text entirely."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model" or spec.model is None:
        return
    field = "speculative_config.model"
    try:
        draft = Tokenizer.from_pretrained(spec.model)
    except (OSError, ValueError, KeyError) as e:
        raise InvalidRequestError(field, f"cannot read the draft model's tokenizer at {spec.model!r}: {e}") from e
    ours, theirs = target.backend.get_vocab(with_added_tokens=True), draft.backend.get_vocab(with_added_tokens=True)
    if ours != theirs:
        if len(ours) != len(theirs):
            why = f"{len(theirs)} tokens against the target's {len(ours)}"
        else:
            token = next(t for t in sorted(ours) if ours[t] != theirs.get(t))
            why = (f"token {token!r} is id {ours[token]} for the target and "
                   f"{theirs.get(token, 'absent')} for the draft")
        raise InvalidRequestError(field, f"the draft model {spec.model!r} has another tokenizer ({why}): a draft "
                                         "model must share the target's tokenizer")
    for name in ("bos_token_id", "eos_token_id"):
        if getattr(target, name) != getattr(draft, name):
            raise InvalidRequestError(field, f"the draft model {spec.model!r} has {name} {getattr(draft, name)}, "
                                             f"the target {getattr(target, name)}: a draft model must share the "
                                             "target's tokenizer")
