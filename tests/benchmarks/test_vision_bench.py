"""benchmarks/vision.py's pure helpers: the request body the openai SDK's chat types accept, images that decode back
to their pixels and differ per seed (so no cache hits), the summary, and the call timer."""

from __future__ import annotations

import base64
import io
import time

import numpy as np
import pytest
from openai.types.chat import CompletionCreateParams
from PIL import Image
from pydantic import TypeAdapter

from benchmarks.vision import _timed, chat_body, data_url, image, prompt_text, summarize


def test_the_body_is_an_openai_chat_request_with_one_image() -> None:
    body = chat_body("m", "data:image/png;base64,AAAA", "w10 w11", 16)
    TypeAdapter(CompletionCreateParams).validate_python({k: v for k, v in body.items() if k != "ignore_eos"})
    assert body["messages"] == [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "w10 w11"}]}]
    assert (body["stream"], body["max_tokens"], body["temperature"], body["ignore_eos"]) == (True, 16, 0, True)


def test_images_round_trip_their_pixels_and_differ_per_seed() -> None:
    url = data_url(image(3, size=8))
    assert url.startswith("data:image/png;base64,")
    decoded = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))
    np.testing.assert_array_equal(decoded, np.asarray(image(3, size=8)))
    assert len({data_url(image(s, size=8)) for s in range(20)}) == 20
    assert len({prompt_text(i) for i in range(100)}) == 100 and len(prompt_text(0).split()) == 24


def test_summary() -> None:
    s = summarize([0.5, 0.1, 0.3, 0.2], images=4, span_s=2.0)
    assert (s["images"], s["ttft_p50_s"], s["ttft_p99_s"], s["images_per_s"]) == (4, 0.2, 0.5, 2.0)
    assert summarize([], 0, 0.0)["images_per_s"] == 0.0


def test_the_timer_adds_each_call_and_puts_the_method_back() -> None:
    class Owner:
        def work(self, x: int) -> int:
            time.sleep(0.01)
            return x + 1

    spent = [0.0]
    original = Owner.work
    with _timed(Owner, "work", spent):
        assert Owner().work(1) == 2 and Owner().work(2) == 3
    assert Owner.work is original and spent[0] == pytest.approx(0.02, abs=0.015)
