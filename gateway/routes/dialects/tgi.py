"""Text Generation Inference's REST dialect: ``POST /`` (what TGI's own Python client calls), ``POST /generate``,
``POST /generate_stream`` and ``GET /info``, as a thin layer over the completion route's typed request.

A body is ``{"inputs", "parameters": {...}, "stream"}``; ``parameters`` are re-spelt under the OpenAI names
(``max_new_tokens`` → ``max_tokens``, ``top_n_tokens`` → ``logprobs``, ``decoder_input_details`` →
``prompt_logprobs``, ``grammar`` → ``guided_json`` / ``guided_regex``, ``adapter_id`` → the LoRA adapter's
``model``, ``truncate`` → ``truncate_prompt_tokens``: the prompt's last this many tokens, as TGI keeps them) and
validated as a completion; ``typical_p`` and ``watermark`` are refused. MindIE's
extras ``priority`` and ``timeout`` are honoured too (its ``/infer`` shares this parser). Answers:
``{"generated_text", "details"}`` (a list of one on ``POST /``), or server-sent events of TGI's
``StreamResponse``, one per generated token, the last with ``generated_text`` and ``details``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from importlib import metadata
from typing import Annotated, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.backend import Delta, FinishReason, PromptTokenLogprob, TokenLogprob, TopLogprob
from gateway.errors import ApiError, BackendError, bad_request
from gateway.fields import validate
from gateway.models import Int, JsonObject, Number
from gateway.routes.common import gateway_state, read_json, request_id, resolve_model
from gateway.routes.dialects import driver
from gateway.routes.dialects.errors import answering, tgi_body, tgi_response
from gateway.routes.dialects.request import DialectModel, adapter, as_completion, refuse_set, temperature, tgi_finish
from gateway.routes.generate import Run
from gateway.schemas import MAX_STOP_STRINGS, GenerationRequest
from gateway.sse import event

DEFAULT_MAX_NEW_TOKENS = 20  # TGI's documented default (and its Python client's)
# The OpenAI field each TGI field is validated as, for the errors that name them.
NAMES = {"prompt": "inputs", "max_tokens": "parameters.max_new_tokens", "logprobs": "parameters.top_n_tokens",
         "prompt_logprobs": "parameters.decoder_input_details", "guided_json": "parameters.grammar",
         "guided_regex": "parameters.grammar", "model": "parameters.adapter_id",
         "truncate_prompt_tokens": "parameters.truncate",
         **{name: f"parameters.{name}" for name in ("temperature", "top_k", "top_p", "repetition_penalty",
                                                    "frequency_penalty", "seed", "stop", "best_of", "priority")}}
REFUSED = {"typical_p": "typical decoding is not implemented",
           "watermark": "watermarking is not implemented"}


class Grammar(DialectModel):
    type: Literal["json", "regex"]
    value: JsonObject | str  # json: a schema (object or its text); regex: the expression


class Parameters(DialectModel):
    best_of: Int | None = None
    decoder_input_details: bool | None = None
    details: bool | None = None
    do_sample: bool | None = None
    frequency_penalty: Number | None = None
    grammar: Grammar | None = None
    max_new_tokens: Int | None = None
    repetition_penalty: Number | None = None
    return_full_text: bool | None = None
    seed: Int | None = None
    stop: list[str] | None = None
    temperature: Number | None = None
    top_k: Int | None = None
    top_n_tokens: Int | None = None
    top_p: Number | None = None
    truncate: Int | None = None
    typical_p: Number | None = None
    watermark: bool | None = None
    adapter_id: str | None = None
    priority: Int | None = None  # MindIE's; lower runs earlier (needs the engine's --scheduling-policy priority)
    timeout: Annotated[Number, Field(gt=0)] | None = None  # MindIE's: the request's deadline in seconds


class TgiRequest(DialectModel):
    inputs: Annotated[str, Field(min_length=1)]
    parameters: Parameters | None = None
    stream: bool | None = None


@dataclass(frozen=True)
class TgiCall:
    """A validated TGI request: the completion route's request, and what shapes TGI's answer."""

    gen: GenerationRequest
    inputs: str
    details: bool
    top_n_tokens: int
    return_full_text: bool
    seed: int | None
    timeout: float | None

    @property
    def stream(self) -> bool:
        return self.gen.stream


def parse_tgi(body: dict[str, object], max_n: int, *, stream: bool | None = None) -> TgiCall:
    """``stream``: the route's (``/generate_stream``: True); None: the body's ``stream``, default false."""
    req = validate(TgiRequest, body)
    p = req.parameters or Parameters()
    refuse_set(p.model_dump(include=set(REFUSED)), REFUSED, prefix="parameters.")
    if stream is not None and req.stream is not None and req.stream is not stream:
        raise bad_request("stream", f"`stream` must be {str(stream).lower()} on this route, or left out.")
    streams = stream if stream is not None else bool(req.stream)
    if streams and p.decoder_input_details:
        raise bad_request("parameters.decoder_input_details",
                          "`parameters.decoder_input_details` is not available when streaming.")
    if streams and p.best_of is not None and p.best_of > 1:
        raise bad_request("parameters.best_of", "`parameters.best_of` > 1 is not available when streaming.")
    for name in ("top_n_tokens", "decoder_input_details"):  # shown in `details` only, when not streamed
        if not streams and not p.details and getattr(p, name):
            raise bad_request(f"parameters.{name}", f"`parameters.{name}` needs `parameters.details` set to true.")
    guided = {f"guided_{p.grammar.type}": p.grammar.value} if p.grammar is not None else {}
    gen = as_completion({
        "prompt": req.inputs, "model": adapter(p.adapter_id),
        "max_tokens": DEFAULT_MAX_NEW_TOKENS if p.max_new_tokens is None else p.max_new_tokens,
        "temperature": temperature(bool(p.do_sample), p.temperature, p.top_k, p.top_p),
        "top_k": p.top_k, "top_p": p.top_p, "repetition_penalty": p.repetition_penalty,
        "frequency_penalty": p.frequency_penalty, "seed": p.seed, "stop": p.stop, "best_of": p.best_of,
        # Token details need each token's log probability; top_n_tokens its alternatives.
        "logprobs": p.top_n_tokens if p.top_n_tokens is not None else 0 if p.details else None,
        "prompt_logprobs": 0 if p.decoder_input_details else None,
        "priority": p.priority, "stream": streams, "truncate_prompt_tokens": p.truncate, **guided,
    }, max_n, NAMES)
    return TgiCall(gen, req.inputs, bool(p.details), p.top_n_tokens or 0, bool(p.return_full_text), p.seed,
                   p.timeout)


def _token(lp: TokenLogprob | TopLogprob, special: bool = False) -> dict[str, object]:
    return {"id": lp.token_id, "text": lp.text, "logprob": lp.logprob, "special": special}


def _prefill(lp: PromptTokenLogprob) -> dict[str, object]:
    return {"id": lp.token_id, "text": lp.text, "logprob": lp.logprob}


def whole_body(call: TgiCall, run: Run) -> dict[str, object]:
    """TGI's ``GenerateResponse``: the text, and with ``details`` its tokens and why it ended."""
    choice = run.builder.choices[0]
    text = "".join(choice.text)
    out: dict[str, object] = {"generated_text": call.inputs + text if call.return_full_text else text}
    if call.details:
        # The end-of-sequence token is special unless its text is the output's end (special tokens kept).
        last = choice.logprobs[-1] if choice.logprobs else None
        eos = len(choice.logprobs) - 1 if choice.finish_reason is FinishReason.EOS and last is not None \
            and not text.endswith(last.text) else None
        out["details"] = {
            "finish_reason": tgi_finish(choice.finish_reason),
            "generated_tokens": run.usage.total().completion_tokens,
            "seed": call.seed,
            "prefill": [_prefill(lp) for lp in choice.prompt_logprobs],
            "tokens": [_token(lp, special=i == eos) for i, lp in enumerate(choice.logprobs)],
            "top_tokens": [[_token(t) for t in lp.top] for lp in choice.logprobs] if call.top_n_tokens else None,
            "best_of_sequences": None,  # the backend returns the best sequence only
        }
    return out


class TgiFrames:
    """TGI's ``StreamResponse`` events: one per generated token. A delta's text rides on its last token (the
    text of several tokens can only be split where the detokenizer split it); the end-of-sequence token is
    ``special`` when it carries no text. ``timing`` adds MindIE's ``prefill_time`` / ``decode_time``
    (milliseconds, as this gateway saw them)."""

    def __init__(self, call: TgiCall, run: Run, *, timing: bool = False) -> None:
        self.call = call
        self.run = run
        self.timing = timing
        self.index = 0
        self.last_id = 0
        self.since = time.monotonic()

    def delta(self, index: int, delta: Delta) -> list[str]:
        ids = delta.token_ids or ((self.last_id,) if delta.text or delta.finish_reason is not None else ())
        frames = []
        for k, token_id in enumerate(ids):
            last = k == len(ids) - 1
            lp = delta.logprobs[k] if delta.token_ids and k < len(delta.logprobs) else None
            text = delta.text if last else ""
            special = last and delta.finish_reason is FinishReason.EOS and bool(delta.token_ids) and not text
            ev: dict[str, object] = {"index": self.index,
                                     "token": {"id": token_id, "text": text,
                                               "logprob": lp.logprob if lp is not None else None,
                                               "special": special},
                                     "generated_text": None, "details": None}
            if self.call.top_n_tokens:
                ev["top_tokens"] = [_token(t) for t in lp.top] if lp is not None else []
            if last and delta.finish_reason is not None:
                whole = self.run.builder.choices[index]
                text_so_far = "".join(whole.text)
                ev["generated_text"] = self.call.inputs + text_so_far if self.call.return_full_text else text_so_far
                ev["details"] = {"finish_reason": tgi_finish(delta.finish_reason),
                                 "generated_tokens": delta.usage.completion_tokens, "seed": self.call.seed,
                                 "input_length": delta.usage.prompt_tokens}
            if self.timing:
                now = time.monotonic()
                elapsed = round((now - self.since) * 1000, 2)
                ev["prefill_time"], ev["decode_time"] = (elapsed, None) if self.index == 0 else (None, elapsed)
                self.since = now
            frames.append(event(ev))
            self.index += 1
        if delta.token_ids:
            self.last_id = delta.token_ids[-1]
        return frames

    def end(self) -> list[str]:
        return []  # the last token's event carried the end; TGI sends no [DONE]

    def error(self, err: ApiError) -> str:
        return event(tgi_body(err))


async def respond(request: Request, call: TgiCall, *, as_list: bool = False, timing: bool = False) -> Response:
    """``as_list``: ``POST /``'s whole answer, a list of one."""
    state = gateway_state(request)
    model = await resolve_model(request, call.gen.model)
    run = Run(state, call.gen, model, request_id(request), timeout=call.timeout)
    if call.stream:
        return await driver.stream(run, TgiFrames(call, run, timing=timing))
    if not await driver.collect(request, run):
        return Response(status_code=499)
    body = whole_body(call, run)
    return JSONResponse([body] if as_list else body)


@answering(tgi_response)
async def compat_generate(request: Request) -> Response:
    """``POST /``: TGI's route for both; its Python client's ``generate`` and ``generate_stream`` call it."""
    body = await read_json(request)
    return await respond(request, parse_tgi(body, gateway_state(request).settings.max_n), as_list=True)


@answering(tgi_response)
async def generate_stream(request: Request) -> Response:
    body = await read_json(request)
    return await respond(request, parse_tgi(body, gateway_state(request).settings.max_n, stream=True))


@answering(tgi_response)
async def info(request: Request) -> Response:
    """TGI's ``/info``, with MindIE's ``models`` list and ``max_input_length``; what this gateway cannot know
    (the engine's batch limits) is null."""
    state = gateway_state(request)
    try:
        name = (await state.models.names())[0]
        max_model_len = (await state.models.info(state.settings.unary_timeout)).max_model_len
    except BackendError as err:
        raise state.api_error(err) from None
    return JSONResponse({
        "model_id": name, "model_sha": None, "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": None, "max_best_of": state.settings.max_n,
        "max_stop_sequences": MAX_STOP_STRINGS, "max_input_tokens": max_model_len - 1,
        "max_input_length": max_model_len - 1, "max_total_tokens": max_model_len,
        "max_batch_total_tokens": None, "max_waiting_tokens": None, "max_batch_size": None,
        "validation_workers": None, "max_client_batch_size": 1, "router": "sluice", "version": _version(),
        "sha": None, "docker_label": None,
        "models": [{"model_id": name, "model_sha": None, "model_pipeline_tag": "text-generation",
                    "model_dtype": None, "model_device_type": None, "max_total_tokens": max_model_len}],
    })


def _version() -> str | None:
    try:
        return metadata.version("sluice")
    except metadata.PackageNotFoundError:
        return None
