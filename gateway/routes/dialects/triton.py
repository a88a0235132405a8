"""Triton's generate extension (``POST /v2/models/{model}/generate`` and ``/generate_stream``) and its health
routes (``GET /v2/health/live``, ``/v2/health/ready``, ``/v2/models/{model}/ready``), as MindIE serves them.

A body is ``{"text_input", "parameters": {...}, "id"}``. Triton hands top-level fields to the model as its
inputs (TensorRT-LLM's backend reads ``max_tokens``, ``stop_words``, ``stream`` there) and ``parameters`` to
it as request parameters (vLLM's backend and MindIE read the sampling fields there): each field below is
taken from either place, never both, under vLLM's names or their aliases (``max_new_tokens``,
``stop_words``, ``random_seed``; TGI's ``do_sample`` and MindIE's ``details``, ``priority``, ``timeout``). A
top-level field the model has no input for is refused, as Triton refuses it; the fields Sluice cannot honour
are refused by name. ``text_output`` is the generated text (MindIE's), with the prompt before it when
``exclude_input_in_output`` is false (Triton's vLLM backend's default). Errors are ``{"error": message}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.backend import Delta, FinishReason, Usage
from gateway.errors import ApiError, bad_request
from gateway.fields import validate
from gateway.models import Int, Number
from gateway.routes.common import ModelChoice, gateway_state, read_json, request_id, resolve_model
from gateway.routes.dialects import driver
from gateway.routes.dialects.errors import answering, triton_body, triton_response
from gateway.routes.dialects.request import DialectModel, as_completion, refuse_set, temperature, tgi_finish
from gateway.routes.generate import Run
from gateway.schemas import GenerationRequest
from gateway.sse import event

MODEL_VERSION = "1"
# Aliases: the name another backend gives the same field → the name it is read under here.
_ALIASES = {"max_new_tokens": "max_tokens", "stop_words": "stop", "random_seed": "seed"}
REFUSED = {"typical_p": "typical decoding is not implemented", "watermark": "watermarking is not implemented",
           "perf_stat": "per-request statistics are not kept",
           "batch_size": "the engine batches requests itself", "return_log_probs": "the answer carries text only"}
_ROUTE_FIELDS = ("id", "text_input", "parameters")
TextList = str | list[str]


class Fields(DialectModel):
    max_tokens: Int | None = None
    max_new_tokens: Int | None = None
    temperature: Number | None = None
    top_k: Int | None = None
    top_p: Number | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    min_tokens: Int | None = None
    ignore_eos: bool | None = None
    stop: TextList | None = None
    stop_words: TextList | None = None
    seed: Int | None = None
    random_seed: Int | None = None
    do_sample: bool | None = None
    details: bool | None = None
    stream: bool | None = None
    exclude_input_in_output: bool | None = None
    priority: Int | None = None
    timeout: Annotated[Number, Field(gt=0)] | None = None
    typical_p: Number | None = None
    watermark: bool | None = None
    bad_words: TextList | None = None
    perf_stat: bool | None = None
    batch_size: Int | None = None
    return_log_probs: bool | None = None


class TritonRequest(DialectModel):
    text_input: Annotated[str, Field(min_length=1)]
    id: str | None = None
    parameters: Fields | None = None


@dataclass(frozen=True)
class TritonCall:
    gen: GenerationRequest
    text_input: str
    id: str | None
    details: bool
    with_input: bool
    timeout: float | None


def parse_triton(body: dict[str, object], max_n: int, *, stream: bool) -> TritonCall:
    req = validate(TritonRequest, body)
    inputs = {k: v for k, v in body.items() if k not in _ROUTE_FIELDS}
    for name in inputs:
        if name not in Fields.model_fields:
            raise bad_request(name[:64], f"Unexpected inference input `{name[:64]}`: the model takes "
                                         f"{', '.join(Fields.model_fields)} (or these in `parameters`).")
    fields, sent = _merged(validate(Fields, inputs), req.parameters or Fields())
    for name, reason in REFUSED.items():
        if name in sent:
            refuse_set({name: getattr(fields, name)}, {name: reason}, prefix=sent[name].removesuffix(name))
    for alias, name in _ALIASES.items():
        if alias in sent and name in sent:
            raise bad_request(sent[alias], f"`{sent[alias]}` and `{sent[name]}` are the same field: give one.")
        if alias in sent:
            sent[name] = sent.pop(alias)  # errors about the field name it as sent
    if fields.stream is not None and fields.stream is not stream:
        raise bad_request(sent["stream"], f"`{sent['stream']}` is {str(not stream).lower()}: use "
                                          f"/generate{'_stream' if not stream else ''}.")
    stop = fields.stop if fields.stop is not None else fields.stop_words
    bad_words = fields.bad_words
    gen = as_completion({
        "prompt": req.text_input,
        "max_tokens": fields.max_tokens if fields.max_tokens is not None else fields.max_new_tokens,
        "temperature": temperature(fields.do_sample, fields.temperature, fields.top_k, fields.top_p),
        "top_k": fields.top_k, "top_p": fields.top_p, "min_p": fields.min_p,
        "repetition_penalty": fields.repetition_penalty, "presence_penalty": fields.presence_penalty,
        "frequency_penalty": fields.frequency_penalty, "min_tokens": fields.min_tokens,
        "ignore_eos": fields.ignore_eos, "seed": fields.seed if fields.seed is not None else fields.random_seed,
        "stop": ([stop] if stop else None) if isinstance(stop, str) else stop,  # TensorRT-LLM's "": none
        "priority": fields.priority, "stream": stream,
        "bad_words": ([bad_words] if bad_words else None) if isinstance(bad_words, str) else bad_words,
    }, max_n, {"prompt": "text_input", **sent})
    return TritonCall(gen, req.text_input, req.id, fields.details is True, fields.exclude_input_in_output is False,
                      fields.timeout)


def _merged(top: Fields, params: Fields) -> tuple[Fields, dict[str, str]]:
    """The fields given (not null) in either place, and each one's name as sent: ``max_tokens`` (a model input)
    or ``parameters.max_tokens``."""
    values: dict[str, object] = {}
    sent: dict[str, str] = {}
    for place, fields in (("", top), ("parameters.", params)):
        for name in fields.model_fields_set:
            value = getattr(fields, name)
            if value is None:
                continue
            if name in values:
                raise bad_request(name, f"`{name}` is given both as an input and in `parameters`: give one.")
            values[name], sent[name] = value, place + name
    return Fields.model_validate(values), sent


def _head(call: TritonCall, model: ModelChoice) -> dict[str, object]:
    head: dict[str, object] = {"id": call.id} if call.id is not None else {}
    head.update(model_name=model.name, model_version=MODEL_VERSION)
    return head


def _details(reason: FinishReason | None, usage: Usage) -> dict[str, object]:
    return {"finish_reason": tgi_finish(reason), "generated_tokens": usage.completion_tokens,
            "input_length": usage.prompt_tokens}


class TritonFrames:
    """One event per delta with text: ``text_output`` is the new text; the last carries ``details`` when
    asked for."""

    def __init__(self, call: TritonCall, model: ModelChoice) -> None:
        self.call = call
        self.head = _head(call, model)
        self.first = True

    def delta(self, index: int, delta: Delta) -> list[str]:
        if not delta.text and delta.finish_reason is None:
            return []
        text = self.call.text_input + delta.text if self.first and self.call.with_input else delta.text
        self.first = False
        out = {**self.head, "text_output": text}
        if self.call.details and delta.finish_reason is not None:
            out["details"] = _details(delta.finish_reason, delta.usage)
        return [event(out)]

    def end(self) -> list[str]:
        return []

    def error(self, err: ApiError) -> str:
        return event(triton_body(err))


async def _respond(request: Request, *, stream: bool) -> Response:
    state = gateway_state(request)
    model = await resolve_model(request, request.path_params["model"])
    call = parse_triton(await read_json(request), state.settings.max_n, stream=stream)
    run = Run(state, call.gen, model, request_id(request), timeout=call.timeout)
    if stream:
        return await driver.stream(run, TritonFrames(call, model))
    if not await driver.collect(request, run):
        return Response(status_code=499)
    choice = run.builder.choices[0]
    text = "".join(choice.text)
    out = {**_head(call, model), "text_output": call.text_input + text if call.with_input else text}
    if call.details:
        out["details"] = _details(choice.finish_reason, run.usage.total())
    return JSONResponse(out)


@answering(triton_response)
async def generate(request: Request) -> Response:
    return await _respond(request, stream=False)


@answering(triton_response)
async def generate_stream(request: Request) -> Response:
    return await _respond(request, stream=True)


async def live(request: Request) -> Response:
    return Response(status_code=200)


async def ready(request: Request) -> Response:
    """200 when a backend serves, else 400 (the KServe protocol's false is a 4xx; Triton answers 400)."""
    state = gateway_state(request)
    return Response(status_code=200 if await state.backend.check_ready(timeout=state.settings.ready_timeout) else 400)


@answering(triton_response)
async def model_ready(request: Request) -> Response:
    await resolve_model(request, request.path_params["model"])
    return await ready(request)
