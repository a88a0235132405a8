"""A public chat whose messages carry image ``parts``, made into the engine's inputs: each image read (its bytes, a
``data:`` URL, or an http(s) URL fetched from ``--allowed-media-domains`` only, within size and time limits), the
conversation rendered with the model processor's chat template (image parts as ``{"type": "image"}``, as
transformers' templates take them), prompt and images run through the model's own processor
(``engine.text.multimodal``, the code the offline ``LLM.chat`` runs) off the event loop, and each image sent as the
token-level proto's ``MultiModalItem`` with its tensors inline.

Every refusal is an InvalidRequestError naming the part (``messages[i].parts[j]``); nothing is held by then.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import io
import json
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common.errors import InvalidRequestError
from engine.config import parse_mm_limits
from engine.text.multimodal import MultiModalProcessor, ProcessedItem, ProcessedPrompt, is_multimodal
from proto.sluice.v1 import engine_pb2, generation_pb2
from services.tokenizer.chat import chat_inputs
from services.tokenizer.limits import check_chat

# TensorData.dtype's names of the numpy dtypes a processor returns.
_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(np.int64): "int64",
           np.dtype(np.int32): "int32"}


# Runs a function off the event loop (the service's pool: PromptBuilder.off_loop).
OffLoop = Callable[..., Awaitable[Any]]
# Images a message has room for when --limit-mm-per-prompt sets no limit (more must come as URLs).
_UNLIMITED_IMAGES_ROOM = 4


@dataclass(frozen=True)
class MediaSettings:
    """The tokenizer service's image settings (one per process, from its flags)."""

    # vLLM's --limit-mm-per-prompt: the most items of each modality one prompt may carry (None: no limit).
    limit_mm_per_prompt: Mapping[str, int] | None = None
    # vLLM's --allowed-media-domains: hosts http(s) image URLs may be fetched from (empty: none, every URL refused).
    allowed_media_domains: tuple[str, ...] = ()
    max_image_bytes: int = 20 * 2**20   # one image's encoded bytes, given or fetched
    fetch_timeout_s: float = 10.0       # one URL's whole fetch
    max_image_pixels: int = 64 * 2**20  # width × height once decoded (PIL's decompression-bomb guard, made strict)
    domains: frozenset[str] = field(init=False, default=frozenset())

    def __post_init__(self) -> None:
        if self.max_image_bytes < 1 or self.fetch_timeout_s <= 0 or self.max_image_pixels < 1:
            raise ValueError("image size and fetch time limits must be positive")
        object.__setattr__(self, "domains", frozenset(d.strip().lower() for d in self.allowed_media_domains
                                                      if d.strip()))


def add_media_args(parser: argparse.ArgumentParser, *, limit: bool = True) -> None:
    """The image flags (vLLM's names where it has them); ``limit``: with ``--limit-mm-per-prompt`` (``sluice
    serve`` has it among the engine's flags)."""
    g = parser.add_argument_group("images (a vision-language model)")
    if limit:
        g.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                       help='the most images one prompt may carry, e.g. \'{"image": 2}\' (default: no limit)')
    g.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="DOMAIN",
                   help="hosts whose http(s) image URLs are fetched (default none: every such URL is refused)")
    g.add_argument("--max-image-bytes", type=int, default=MediaSettings.max_image_bytes, metavar="N",
                   help="one image's encoded size, given or fetched")
    g.add_argument("--media-fetch-timeout", type=float, default=MediaSettings.fetch_timeout_s, metavar="SECONDS",
                   help="how long fetching one image URL may take")


def media_settings(ns: argparse.Namespace) -> MediaSettings:
    """The flags' settings; ValueError (InvalidRequestError naming the flag) for a bad value."""
    return MediaSettings(parse_mm_limits(ns.limit_mm_per_prompt), tuple(ns.allowed_media_domains),
                         ns.max_image_bytes, ns.media_fetch_timeout)


def media_flags(ns: argparse.Namespace) -> list[str]:
    """The tokenizer service's image flags for ``sluice serve``'s ``ns`` (only those given)."""
    flags = ["--limit-mm-per-prompt", ns.limit_mm_per_prompt] if ns.limit_mm_per_prompt is not None else []
    if ns.allowed_media_domains:
        flags += ["--allowed-media-domains", *ns.allowed_media_domains]
    if ns.max_image_bytes != MediaSettings.max_image_bytes:
        flags += ["--max-image-bytes", str(ns.max_image_bytes)]
    if ns.media_fetch_timeout != MediaSettings.fetch_timeout_s:
        flags += ["--media-fetch-timeout", repr(ns.media_fetch_timeout)]
    return flags


def image_token_id(model_path: str) -> int:
    """The image placeholder's token id in a LLaVA config.json (as the engine's ``llava_config_from_hf`` reads)."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return int(cfg.get("image_token_id", cfg.get("image_token_index", 32000)))


def has_parts(chat: generation_pb2.Chat) -> bool:
    return any(m.parts for m in chat.messages)


class ChatImages:
    """A vision-language model's processor in the tokenizer service; ``processor`` None: a text-only model, whose
    requests with parts are refused."""

    def __init__(self, processor: MultiModalProcessor | None, settings: MediaSettings, model_name: str,
                 chat_template: str | None = None) -> None:
        self.processor = processor
        self.settings = settings
        self.model_name = model_name
        self.chat_template = chat_template  # --chat-template; None: the processor's

    @classmethod
    def load(cls, model_path: str, settings: MediaSettings, model_name: str,
             chat_template: str | None = None) -> ChatImages:
        processor = (MultiModalProcessor(model_path, image_token_id(model_path), settings.limit_mm_per_prompt)
                     if is_multimodal(model_path) else None)
        return cls(processor, settings, model_name, chat_template)

    def message_bytes(self) -> int:
        """Room for a request's images in a public API message: --limit-mm-per-prompt images (4 without a limit)
        of --max-image-bytes each, as data: URLs (base64, 4/3); 0 for a text-only model."""
        if self.processor is None:
            return 0
        count = (self.settings.limit_mm_per_prompt or {}).get("image", _UNLIMITED_IMAGES_ROOM)
        return count * (self.settings.max_image_bytes * 4 // 3 + 256)

    async def prompt(self, request: generation_pb2.GenerateRequest, max_model_len: int, max_chars: int,
                     run: OffLoop) -> tuple[list[int], list[engine_pb2.MultiModalItem]]:
        """The chat's prompt ids (placeholders expanded) and its images as the engine takes them. ``run``: calls a
        function off the event loop (the service's pool)."""
        if request.HasField("truncate_prompt_tokens"):
            raise InvalidRequestError("truncate_prompt_tokens", "is not taken with image parts (it could cut an "
                                                                "image's placeholders)")
        processed = await self.processed(request.chat, max_chars, run)
        if len(processed.prompt_token_ids) > max_model_len:
            raise InvalidRequestError("prompt", f"has {len(processed.prompt_token_ids)} tokens with its images' "
                                                f"placeholders, more than max_model_len ({max_model_len})")
        return processed.prompt_token_ids, [item_to_pb(item) for item in processed.items]

    async def processed(self, chat: generation_pb2.Chat, max_chars: int, run: OffLoop) -> ProcessedPrompt:
        """The chat rendered and run through the model's processor with its images (for ``prompt`` and
        ``Tokenize``)."""
        conversation, sources = self.conversation(chat, max_chars)
        assert self.processor is not None  # conversation() refused parts on a text-only model
        images = [await self._image(where, image, run) for where, image in sources]
        inputs = chat_inputs(chat, with_parts=True)
        result: ProcessedPrompt = await run(self._process, conversation, images, inputs.add_generation_prompt,
                                            inputs.kwargs)
        return result

    def conversation(self, chat: generation_pb2.Chat, max_chars: int
                     ) -> tuple[list[dict[str, Any]], list[tuple[str, generation_pb2.Image]]]:
        """The messages as the processor's template takes them (parts as ``{"type": "text"|"image"}``) and each
        image part with its name, in order; refuses what cannot be served before any image is read."""
        if chat.HasField("chat_template"):
            raise InvalidRequestError("chat_template", "a request's own chat template is not taken with image parts")
        check_chat(chat, max_chars)   # the messages' other fields, tools and template variables
        limit = (self.settings.limit_mm_per_prompt or {}).get("image")
        messages = chat_inputs(chat, with_parts=True).messages
        images: list[tuple[str, generation_pb2.Image]] = []
        chars = 0
        for i, (message, pb) in enumerate(zip(messages, chat.messages)):
            if not pb.parts:
                continue
            if pb.content:
                raise InvalidRequestError(f"messages[{i}].content", "must be empty when parts are given")
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(pb.parts):
                where = f"messages[{i}].parts[{j}]"
                kind = part.WhichOneof("kind")
                if self.processor is None:
                    raise InvalidRequestError(where, f"{self.model_name} is a text-only model: it takes no content "
                                                     "parts (send the text as content)")
                if kind == "text":
                    chars += len(part.text)
                    parts.append({"type": "text", "text": part.text})
                    continue
                if kind != "image":
                    raise InvalidRequestError(where, "one of text or image is required")
                if limit is not None and len(images) >= limit:
                    raise InvalidRequestError(where, f"more than {limit} images in one prompt "
                                                     "(--limit-mm-per-prompt)")
                images.append((where, part.image))
                parts.append({"type": "image"})
            message["content"] = parts
        if chars > max_chars:
            raise InvalidRequestError("messages", f"parts' text is {chars} characters; at most {max_chars} can fit "
                                                  "in the model's context")
        return messages, images

    def _process(self, conversation: list[dict[str, Any]], images: Sequence[Any], add_generation_prompt: bool,
                 kwargs: Mapping[str, Any]) -> ProcessedPrompt:
        """Rendered and processed as ``MultiModalProcessor.process_chat`` does (CPU-bound: run off the loop)."""
        assert self.processor is not None
        hf = self.processor.processor
        template = self.chat_template or getattr(hf, "chat_template", None)
        if not template:
            raise InvalidRequestError("chat_template", "the model's processor has no chat template")
        extra = {k: v for k, v in kwargs.items() if v is not None}
        try:
            text = str(hf.apply_chat_template(conversation, chat_template=template,
                                              add_generation_prompt=add_generation_prompt, tokenize=False, **extra))
        except Exception as e:  # a template's own raise_exception, or an undefined variable
            raise InvalidRequestError("messages", f"the chat template cannot render them: {e}") from None
        bos = hf.tokenizer.bos_token
        return self.processor.process(text, images, add_special_tokens=not (bos and text.startswith(bos)))

    async def _image(self, where: str, image: generation_pb2.Image, run: OffLoop) -> Any:
        source = image.WhichOneof("source")
        if source == "data":
            data = image.data
        elif source == "url" and image.url.startswith("data:"):
            return await run(self._decode_url, where, image.url)
        elif source == "url":
            data = await self._fetch(where, image.url)
        else:
            raise InvalidRequestError(where, "an image needs data or url")
        return await run(self._decode, where, data)

    def _decode_url(self, where: str, url: str) -> Any:
        """A ``data:`` URL's image, its size checked before it decodes (as given bytes are)."""
        if len(url) > self.settings.max_image_bytes * 4 // 3 + 256:
            raise InvalidRequestError(where, f"the image is over {self.settings.max_image_bytes} bytes")
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise InvalidRequestError(where, "a data: URL must be base64 encoded (data:image/png;base64,...)")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise InvalidRequestError(where, f"the image does not decode: {e}") from None
        return self._decode(where, data)

    def _decode(self, where: str, data: bytes) -> Any:
        from PIL import Image, UnidentifiedImageError

        if len(data) > self.settings.max_image_bytes:
            raise InvalidRequestError(where, f"the image is {len(data)} bytes; at most {self.settings.max_image_bytes}")
        try:
            image = Image.open(io.BytesIO(data))   # reads the header only: the size is checked before the pixels
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            raise InvalidRequestError(where, f"the image does not decode: {e}") from None
        self._checked(where, image)
        try:
            image.load()
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            raise InvalidRequestError(where, f"the image does not decode: {e}") from None
        return image

    def _checked(self, where: str, image: Any) -> Any:
        pixels = int(image.width) * int(image.height)
        if pixels > self.settings.max_image_pixels:
            raise InvalidRequestError(where, f"the image is {image.width}x{image.height}; at most "
                                             f"{self.settings.max_image_pixels} pixels")
        return image

    async def _fetch(self, where: str, url: str) -> bytes:
        """An http(s) URL's body, from an allowed domain only, within the size and time limits."""
        parsed = urllib.parse.urlsplit(url)
        host = (parsed.hostname or "").lower()
        if parsed.scheme not in ("http", "https") or not host:
            raise InvalidRequestError(where, "the URL must be a data: URL or an http(s) URL")
        if host not in self.settings.domains:
            allowed = ", ".join(sorted(self.settings.domains)) or "none: fetching URLs is off"
            raise InvalidRequestError(where, f"the domain {host!r} is not in --allowed-media-domains ({allowed})")
        import httpx

        limit = self.settings.max_image_bytes
        try:
            async with asyncio.timeout(self.settings.fetch_timeout_s):
                async with httpx.AsyncClient(follow_redirects=False, timeout=self.settings.fetch_timeout_s) as client:
                    async with client.stream("GET", url) as response:
                        if response.status_code != 200:
                            raise InvalidRequestError(where, f"fetching the image answered HTTP "
                                                             f"{response.status_code}")
                        body = bytearray()
                        async for chunk in response.aiter_bytes():
                            body += chunk
                            if len(body) > limit:
                                raise InvalidRequestError(where, f"the image is over {limit} bytes")
                        return bytes(body)
        except TimeoutError:
            raise InvalidRequestError(where, f"fetching the image took over {self.settings.fetch_timeout_s} s") \
                from None
        except httpx.HTTPError as e:
            raise InvalidRequestError(where, f"fetching the image failed: {type(e).__name__}") from None


def item_to_pb(item: ProcessedItem) -> engine_pb2.MultiModalItem:
    """A processed image (``engine.text.multimodal.ProcessedItem``) as the token-level proto's, tensors inline."""
    out = engine_pb2.MultiModalItem(modality=item.modality, offset=item.offset, length=item.length, hash=item.hash)
    for name, array in item.tensors.items():
        array = np.ascontiguousarray(array)
        dtype = _DTYPES.get(array.dtype)
        if dtype is None:   # float64 sizes and the like: the engine takes them as the nearest it names
            array = array.astype(np.float32 if array.dtype.kind == "f" else np.int64)
            dtype = _DTYPES[array.dtype]
        out.tensors[name].CopyFrom(engine_pb2.TensorData(dtype=dtype, shape=list(array.shape),
                                                         inline=array.astype(array.dtype.newbyteorder("<")).tobytes()))
    return out
