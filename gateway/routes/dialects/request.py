"""What the dialects share on the way in: a body re-spelt as a ``/v1/completions`` body becomes the
completion route's own typed request (one validation, one set of refusals), and the sampling rule of the
dialects that have TGI's ``do_sample``."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict

from gateway.backend import FinishReason
from gateway.errors import ApiError, bad_request
from gateway.routes.dialects.errors import renamed
from gateway.schemas import GenerationRequest, parse_completion

# MindIE's documented request examples send the string "None" in TGI's ``adapter_id`` and vLLM's ``model``,
# meaning none: read as absent, so that those bodies work as they are.
_NONE = "None"
# TGI's finish reasons (MindIE's TGI-style, Triton-style and native routes give them too); a stop token id
# ends a sequence as its end-of-sequence token does.
_TGI_FINISH = {FinishReason.LENGTH: "length", FinishReason.TIME_LIMIT: "length", FinishReason.EOS: "eos_token",
               FinishReason.STOP: "eos_token", FinishReason.STOP_STRING: "stop_sequence"}


class DialectModel(BaseModel):
    """A dialect's body: strict types, unknown fields ignored (as TGI and the OpenAI routes do);
    the known ones Sluice cannot honour are refused by name."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


def as_completion(body: Mapping[str, object], max_n: int, names: Mapping[str, str]) -> GenerationRequest:
    """``body`` (OpenAI's names, None values left out) parsed as ``/v1/completions`` parses it; an error
    names the dialect's field (``names``: OpenAI name → the dialect's)."""
    try:
        return parse_completion({k: v for k, v in body.items() if v is not None}, max_n)
    except ApiError as err:
        raise renamed(err, names) from None


def adapter(name: str | None) -> str | None:
    return None if name == _NONE else name


def temperature(do_sample: bool | None, temperature: float | None, top_k: int | None,
                top_p: float | None) -> float | None:
    """TGI's rule: sampling when ``do_sample`` or any of temperature / top_k / top_p is given, else greedy
    (temperature 0). Without ``do_sample`` at all (Triton's vLLM and TensorRT-LLM backends have none) the
    temperature is as given."""
    if do_sample is False and temperature is None and top_k is None and top_p is None:
        return 0.0
    return temperature


def refuse_set(values: Mapping[str, object], why: Mapping[str, str], prefix: str = "") -> None:
    """A field Sluice cannot honour, set to anything but a do-nothing value (null, false, "" or []): a 400
    naming it (``why``: field → reason), never read and ignored."""
    for name, reason in why.items():
        value = values.get(name)
        if not (value is None or value is False or value == "" or value == []):
            raise bad_request(prefix + name, f"`{prefix}{name}` is not supported: {reason}.")


def tgi_finish(reason: FinishReason | None) -> str:
    """TGI has no other reasons: a sequence cut short any other way (aborted) did not finish, so "length"."""
    return _TGI_FINISH.get(reason, "length") if reason is not None else "length"
