"""What a sequence reports each step: its new tokens, or (best_of, beam search) its request's best sequences
once, when the request ends."""

from __future__ import annotations

from engine.core.beam import Hypothesis
from engine.core.finish_reason import FinishReason
from engine.core.outputs import EngineCoreOutput
from engine.core.request import Request


def delta_output(request: Request, stream_interval: int) -> EngineCoreOutput | None:
    """The tokens of ``request`` not yet reported, or None while its stream interval holds them back
    (``stream_interval``: the engine's; a request may ask for a longer one).

    The first token always goes at once (time to first token is never traded away), and a finished
    request reports whatever is left with its finish reason."""
    start = request.num_reported_tokens
    interval = max(request.sampling_params.stream_interval or 1, stream_interval)
    if (interval > 1 and start > 0 and request.finish_reason is None
            and request.num_output_tokens - start < interval):
        return None
    request.num_reported_tokens = request.num_output_tokens
    received, request.kv_blocks_received = request.kv_blocks_received, 0   # said once
    cumulative = (request.cumulative_logprob
                  if request.finish_reason is not None and request.sampling_params.logprobs is not None else None)
    return EngineCoreOutput(request.request_id, request.output_token_ids[start:],
                            request.output_logprobs[start:] if request.output_logprobs else None,
                            request.finish_reason, request.num_prompt_tokens, request.num_cached_tokens,
                            index=request.index, request_finished=request.ends_request,
                            cumulative_logprob=cumulative,
                            prompt_logprobs=request.prompt_logprobs if start == 0 else None,
                            times=request.times() if request.ends_request else None,
                            kv_transfer=request.kv_transfer_out, kv_blocks_received=received)


def best_of_outputs(request: Request) -> list[EngineCoreOutput]:
    """The ended best_of request's ``num_returned`` sequences with the highest cumulative logprob, best
    first, renumbered 0..n-1, each whole in one output."""
    best = sorted(request.sequences, key=lambda s: (-s.cumulative_logprob, s.index))[:request.num_returned]
    asked = request.sampling_params.logprobs is not None
    return [EngineCoreOutput(s.request_id, list(s.output_token_ids), list(s.output_logprobs) if asked else None,
                             s.finish_reason, s.num_prompt_tokens, s.num_cached_tokens, index=i,
                             request_finished=i == len(best) - 1, cumulative_logprob=s.cumulative_logprob,
                             prompt_logprobs=s.prompt_logprobs, times=request.times() if i == len(best) - 1 else None)
            for i, s in enumerate(best)]


def beam_outputs(first: Request, best: list[Hypothesis]) -> list[EngineCoreOutput]:
    """The ended beam search's best hypotheses as outputs 0..n-1, best first; ``first``: one of its beams."""
    outputs = [EngineCoreOutput(first.request_id, list(h.token_ids), None, h.finish_reason,
                                first.num_prompt_tokens, first.num_cached_tokens, index=i,
                                cumulative_logprob=h.cumulative_logprob, prompt_logprobs=first.prompt_logprobs)
               for i, h in enumerate(best)]
    if not outputs:   # no hypothesis at all (cannot happen with a vocabulary of 2 * width tokens)
        outputs.append(EngineCoreOutput(first.request_id, [], None, FinishReason.LENGTH,
                                        first.num_prompt_tokens, first.num_cached_tokens))
    outputs[-1].request_finished = True
    outputs[-1].times = first.times()
    return outputs
