"""OpenAI chat content arrays as the gateway's types: text only stays one string (as before, for every model); an
array with ``image_url`` parts keeps its parts in order, sent as the public API's ``ChatMessage.parts`` (the
tokenizer service reads the images, and refuses them for a text-only model naming ``messages[i].parts[j]``, whose
``j`` is the part's index in the content array). ``detail`` is ``auto`` or absent (``low`` and ``high`` are
refused by the request model)."""
from __future__ import annotations

from collections.abc import Sequence

from gateway.backend import ContentPart
from gateway.models import ImageURLPart, TextPart


def content_parts(content: str | Sequence[TextPart | ImageURLPart]) -> tuple[str, tuple[ContentPart, ...]]:
    """(the text, no parts) for a string or an array of text parts (joined by newlines); ("", the parts) for an
    array with images."""
    if isinstance(content, str):
        return content, ()
    if not any(isinstance(part, ImageURLPart) for part in content):
        return "\n".join(part.text for part in content if isinstance(part, TextPart)), ()
    return "", tuple(ContentPart(image_url=part.image_url.url) if isinstance(part, ImageURLPart)
                     else ContentPart(text=part.text) for part in content)
