"""vLLM's ``cache_salt`` end to end on the shared `sluice serve` stack, through the official openai SDK: the
``usage.prompt_tokens_details.cached_tokens`` each request is told shows which requests shared cached blocks."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.e2e.conftest import SHARED_SERVED
from tests.procs import ServeStack

pytestmark = pytest.mark.slow


def test_only_requests_with_the_same_salt_share_cached_tokens(shared_stack: ServeStack) -> None:
    client = openai.OpenAI(base_url=f"{shared_stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    # A prompt no other test sends: ~150 tokens, several full blocks.
    prompt = f"Request {uuid.uuid4().hex}: " + " ".join(f"item {i} is number {i * 7}." for i in range(25))

    def cached(salt: str | None, chat: bool = False) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        if chat:
            c = client.chat.completions.create(model=SHARED_SERVED, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=1, extra_body=extra)
            usage = c.usage
        else:
            r = client.completions.create(model=SHARED_SERVED, prompt=prompt, max_tokens=1, extra_body=extra)
            usage = r.usage
        assert usage is not None and usage.prompt_tokens > 100
        details = usage.prompt_tokens_details
        return 0 if details is None or details.cached_tokens is None else details.cached_tokens

    assert cached("alice") == 0
    assert cached("bob") == 0           # another salt
    assert cached(None) == 0            # no salt
    assert cached("alice") >= 96        # the same salt: its full blocks
    assert cached(None) >= 96
    assert cached("alice", chat=True) == 0 and cached("alice", chat=True) >= 96
    with pytest.raises(openai.BadRequestError) as e:
        cached("")
    assert "cache_salt" in str(e.value)
