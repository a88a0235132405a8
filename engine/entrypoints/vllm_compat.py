"""vLLM's ``serve`` flags that Sluice has no setting of its own for: each is accepted with its effect, accepted
because its effect is already how Sluice works (one log line says so), or refused with the reason.

A vLLM command line (the vLLM-Ascend guides', say) then runs as written, or stops at once with a one-line
reason naming the flag, never at argparse's bare "unrecognized arguments". The flags are declared once, in
``ENGINE_FLAGS``; ``services/supervisor.py`` declares the API server's in the same form. docs/serving.md
("vLLM flags") lists every one.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from common.argtypes import at_least
from common.errors import InvalidRequestError
from engine.config import QUANTIZATIONS

# The value given (never None: a flag not given is not checked) and the whole namespace -> a reason to
# refuse that value, or None to accept it.
Refusal = Callable[[Any, argparse.Namespace], str | None]


def _never(value: Any, ns: argparse.Namespace) -> str | None:
    return None


@dataclass(frozen=True)
class CompatFlag:
    """One vLLM flag. ``no_effect``: why an accepted value changes nothing here (logged); None when the flag
    is implemented by the code that reads its ``dest``; a function of the value when only some values have no
    effect. ``refuse``: the values Sluice cannot honour."""

    names: tuple[str, ...]
    no_effect: str | Callable[[Any], str | None] | None
    refuse: Refusal = _never
    kind: str = "value"                       # value | switch (given or not) | bool (--x / --no-x)
    type: Callable[[str], Any] = str
    choices: Sequence[str] | None = None
    help: str | None = None

    @property
    def dest(self) -> str:
        return self.names[0].lstrip("-").replace("-", "_")

    def add_to(self, group: argparse._ArgumentGroup) -> None:
        shown = self.no_effect if isinstance(self.no_effect, str) else None
        kwargs: dict[str, Any] = {"dest": self.dest, "default": None, "help": self.help or shown}
        if self.kind == "switch":
            kwargs["action"] = "store_const"
            kwargs["const"] = True
        elif self.kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = self.type
            kwargs["choices"] = self.choices
        group.add_argument(*self.names, **kwargs)


def refuse_always(reason: str) -> Refusal:
    return lambda value, ns: reason


def refuse_unless(allowed: Callable[[Any], bool], reason: str) -> Refusal:
    return lambda value, ns: None if allowed(value) else reason


_non_negative = at_least(0)
_positive_int = at_least(1, integer=True)


def _is_gguf(ns: argparse.Namespace) -> bool:
    """The default model is a GGUF file; otherwise the path says."""
    model = getattr(ns, "model", None)
    return model is None or str(model).endswith(".gguf")


def _load_format(value: str, ns: argparse.Namespace) -> str | None:
    if value == "auto" or value == ("gguf" if _is_gguf(ns) else "safetensors"):
        return None
    return (f"{value!r} is not this model's format: Sluice loads an HF directory's safetensors or a .gguf "
            "file, chosen by the path (auto)")


def _quantization(value: str, ns: argparse.Namespace) -> str | None:
    if value in QUANTIZATIONS or (value == "gguf" and _is_gguf(ns)):
        return None
    if value == "gguf":
        return "'gguf' needs a .gguf model file"
    supported = f"Sluice runs {', '.join(QUANTIZATIONS)} (docs/quantization.md) and a GGUF file's own blocks (gguf)"
    return f"{value!r} is not supported: {supported}"


_HUB = "Sluice loads local files only and never downloads: give that revision's directory as the model"
# vLLM v0's speculative decoding flags, replaced in vLLM (and here) by --speculative-config's keys.
_SPEC_V0 = "is vLLM v0's flag; give --speculative-config '{json}' instead"
_OVERRIDE = "overriding the model's own configuration is not supported"

ENGINE_FLAGS: tuple[CompatFlag, ...] = (
    CompatFlag(("--trust-remote-code",), "Sluice runs only its own model code; nothing in the model's directory "
                                         "is ever executed", kind="switch"),
    CompatFlag(("--revision",), None, refuse_always(f"selects a Hugging Face Hub revision; {_HUB}")),
    CompatFlag(("--code-revision",), None, refuse_always(f"selects a Hub revision of the model's code; {_HUB}")),
    CompatFlag(("--tokenizer-revision",), None, refuse_always(f"selects a Hub revision of the tokenizer; {_HUB}")),
    CompatFlag(("--download-dir",), "Sluice never downloads weights: the model is a local path"),
    CompatFlag(("--hf-token",), "Sluice never downloads from the Hugging Face Hub"),
    CompatFlag(("--load-format",), "the weights' format follows the model path (HF safetensors or .gguf)",
               _load_format),
    CompatFlag(("--quantization", "-q"),
               lambda v: "a GGUF file's quantized blocks are always run as they are" if v == "gguf" else None,
               _quantization,
               help="w8a8: int8 weights and activations, quantized at load; compressed-tensors: a W8A8 int8 "
                    "checkpoint's own weights; ascend (or modelslim): an msModelSlim W8A8 / W8A8_DYNAMIC "
                    "checkpoint's (both detected without the flag); gguf: a GGUF file's blocks, as always"),
    CompatFlag(("--tokenizer-mode",), "Sluice always uses the model's fast (Rust) tokenizer",
               refuse_unless(lambda v: v in ("auto", "hf"), "only the model's fast (Rust) tokenizer is supported "
                                                            "(auto)")),
    CompatFlag(("--enable-chunked-prefill",), "prefill is always chunked: prompts share each step's "
                                              "--max-num-batched-tokens budget with decodes", kind="bool",
               refuse=refuse_unless(bool, "Sluice always chunks prefill (one token budget per step, no prefill "
                                          "phase); it cannot be turned off")),
    CompatFlag(("--swap-space",), "Sluice preempts by recompute (as vLLM V1 does): nothing is swapped to CPU "
                                  "memory", type=_non_negative),
    CompatFlag(("--preemption-mode",), "Sluice preempts by recompute",
               refuse_unless(lambda v: v == "recompute", "only recompute preemption is implemented")),
    CompatFlag(("--cpu-offload-gb",), "no weights are offloaded at 0", type=_non_negative,
               refuse=refuse_unless(lambda v: v == 0, "offloading weights to CPU memory is not implemented")),
    CompatFlag(("--num-gpu-blocks-override",), None, type=_positive_int,
               help="vLLM's name for --num-kv-blocks: exactly this many KV cache blocks"),
    CompatFlag(("--disable-async-output-proc",), "output processing (detokenization, stop strings) already runs "
                                                 "in the tokenizer service, apart from the engine's step loop",
               kind="switch"),
    CompatFlag(("--use-v2-block-manager",), "Sluice has one block manager", kind="switch"),
    CompatFlag(("--disable-custom-all-reduce",), "Sluice's all-reduce is always torch.distributed's (gloo, NCCL or "
                                                 "HCCL)", kind="switch"),
    CompatFlag(("--compilation-config",), "Sluice runs eagerly and compiles nothing; its kernels are chosen when "
                                          "the model loads"),
    CompatFlag(("--additional-config",), "vLLM-Ascend's plugin options (graph mode, its scheduler) have no "
                                         "counterpart: Sluice runs eagerly with one scheduler"),
    CompatFlag(("--max-parallel-loading-workers",), "the engine loads the weights in one pass",
               type=_positive_int),
    CompatFlag(("--tokenizer-pool-size",), "tokenization runs on the tokenizer service's threads (scale it with "
                                           "--tokenizers)", type=int),
    CompatFlag(("--speculative-model",), None, refuse_always(_SPEC_V0.format(
        json='{"model": ..., "num_speculative_tokens": ...}'))),
    CompatFlag(("--num-speculative-tokens",), None, refuse_always(_SPEC_V0.format(
        json='{"method": ..., "num_speculative_tokens": ...}')), type=int),
    CompatFlag(("--ngram-prompt-lookup-max",), None, refuse_always(_SPEC_V0.format(
        json='{"method": "ngram", "prompt_lookup_max": ..., "num_speculative_tokens": ...}')), type=int),
    CompatFlag(("--ngram-prompt-lookup-min",), None, refuse_always(_SPEC_V0.format(
        json='{"method": "ngram", "prompt_lookup_min": ..., "num_speculative_tokens": ...}')), type=int),
    CompatFlag(("--override-generation-config",), None, refuse_always(_OVERRIDE)),
    CompatFlag(("--hf-overrides",), None, refuse_always(_OVERRIDE)),
    CompatFlag(("--rope-scaling",), None, refuse_always(_OVERRIDE)),
    CompatFlag(("--rope-theta",), None, refuse_always(_OVERRIDE)),
    CompatFlag(("--task",), "text generation is what Sluice serves",
               refuse_unless(lambda v: v in ("auto", "generate"),
                             "vLLM's older flag; a pooling model runs with --runner pooling (and --convert embed "
                             "or classify)")),
    CompatFlag(("--limit-mm-per-prompt",), None,
               help='the most images one prompt may carry, as JSON: \'{"image": 2}\' (default: no limit); '
                    "the engine and the tokenizer services refuse more"),
    CompatFlag(("--enable-sleep-mode",), None, refuse_always("sleep mode is not implemented"), kind="switch"),
    CompatFlag(("--skip-tokenizer-init",), None, refuse_always("the tokenizer service needs the tokenizer"),
               kind="switch"),
)

# Flags Sluice has under vLLM's name whose values it cannot all honour.
_ENGINE_VALUE_LIMITS: tuple[tuple[str, str, Refusal], ...] = (
    ("distributed_executor_backend", "--distributed-executor-backend",
     refuse_unless(lambda v: v != "external_launcher", "external_launcher (one engine per rank, each started by "
                                                       "torchrun) is not supported: the engine starts its ranks "
                                                       "itself, as processes (mp) or Ray actors (ray)")),
)
# Values only a whole `sluice serve` honours: `sluice engine` refuses them (one engine is one replica).
_ENGINE_PROCESS_LIMITS: tuple[tuple[str, str, Refusal], ...] = (
    ("data_parallel_size", "--data-parallel-size",
     refuse_unless(lambda v: v == 1, "one engine is one replica: `sluice serve --data-parallel-size N` runs N "
                                     "engines behind its gateways")),
)


def add_compat_flags(parser: argparse.ArgumentParser, flags: Sequence[CompatFlag], title: str) -> None:
    group = parser.add_argument_group(title, "accepted for vLLM command lines; docs/serving.md says what each does")
    for flag in flags:
        flag.add_to(group)


def add_vllm_compat_args(parser: argparse.ArgumentParser) -> None:
    add_compat_flags(parser, ENGINE_FLAGS, "vLLM engine flags without a Sluice setting of their own")


def check_compat_flags(ns: argparse.Namespace, flags: Sequence[CompatFlag],
                       limits: Sequence[tuple[str, str, Refusal]] = ()) -> list[str]:
    """Raises InvalidRequestError (naming the flag) for the first value Sluice cannot honour; returns one
    line per accepted flag that has no effect, saying why."""
    notes = []
    for dest, name, refuse in limits:
        value = getattr(ns, dest, None)
        if value is not None and (reason := refuse(value, ns)) is not None:
            raise InvalidRequestError(name, reason)
    for flag in flags:
        value = getattr(ns, flag.dest, None)
        if value is None:
            continue
        shown = flag.names[0] if value is not False else "--no-" + flag.names[0][2:]
        if (reason := flag.refuse(value, ns)) is not None:
            raise InvalidRequestError(shown, reason)
        note = flag.no_effect(value) if callable(flag.no_effect) else flag.no_effect
        if note is not None:
            notes.append(f"{shown} has no effect: {note}")
    return notes


def check_vllm_compat(ns: argparse.Namespace, *, serve: bool = False) -> list[str]:
    """The engine flags' check; ``serve``: for `sluice serve`, which also runs data-parallel replicas."""
    return check_compat_flags(ns, ENGINE_FLAGS, _ENGINE_VALUE_LIMITS + (() if serve else _ENGINE_PROCESS_LIMITS))


def normalize_flag_spelling(argv: Sequence[str]) -> list[str]:
    """vLLM's spellings of a flag, as its parser reads them: underscores in a long option's name become dashes
    (``--max_model_len``; its guides use both), and a JSON flag's keys given one by one (``--speculative-config.
    num_speculative_tokens 3``) are gathered into that flag's JSON object."""
    out = []
    for arg in argv:
        if arg.startswith("--") and "_" in arg:
            name, sep, value = arg.partition("=")
            flag, dot, keys = name.partition(".")   # keys after the dot are JSON's: left as given
            arg = flag.replace("_", "-") + dot + keys + sep + value
        out.append(arg)
    return gather_dotted_keys(out)


def gather_dotted_keys(argv: Sequence[str]) -> list[str]:
    """``--flag.key VALUE`` (``--flag.key=VALUE``; ``--flag.a.b VALUE`` for a nested key) into ``--flag JSON``, as
    vLLM's FlexibleArgumentParser does: VALUE is read as JSON, else kept as a string; dashes in a key become
    underscores. The keys are merged over the flag's whole JSON object when that is given too, else appended as
    one ``--flag JSON``."""
    out: list[str] = []
    gathered: dict[str, dict[str, Any]] = {}
    args = iter(argv)
    for arg in args:
        name, sep, value = arg.partition("=")
        if not (name.startswith("--") and "." in name):
            out.append(arg)
            continue
        if not sep:
            value = next(args, "")
        flag, *keys = name.split(".")
        try:
            parsed: Any = json.loads(value)
        except ValueError:
            parsed = value
        node = gathered.setdefault(flag, {})
        *parents, last = [key.replace("-", "_") for key in keys]
        for key in parents:
            if not isinstance(node.get(key), dict):   # a later --flag.a.b replaces an earlier --flag.a
                node[key] = {}
            node = node[key]
        node[last] = parsed
    for flag, values in gathered.items():
        _merge_into_whole(out, flag, values)
    return out


def _merge_into_whole(argv: list[str], flag: str, keys: dict[str, Any]) -> None:
    """Merge ``keys`` into the last ``flag JSON`` of ``argv`` (in place), or append ``flag JSON``. A whole value
    that is not a JSON object is left for the flag's own reader to refuse."""
    for i in range(len(argv) - 1, -1, -1):
        name, sep, text = argv[i].partition("=")
        if name != flag or (not sep and i + 1 == len(argv)):
            continue
        at = i if sep else i + 1
        text = text if sep else argv[at]
        try:
            whole = json.loads(text)
        except ValueError:
            return
        if isinstance(whole, dict):
            _deep_update(whole, keys)
            argv[at] = f"{flag}={json.dumps(whole)}" if sep else json.dumps(whole)
        return
    argv += [flag, json.dumps(keys)]


def _deep_update(into: dict[str, Any], keys: dict[str, Any]) -> None:
    for key, value in keys.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_update(into[key], value)
        else:
            into[key] = value
