"""The command lines ``sluice serve`` gives its engines and tokenizer services for the settings it resolved."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from engine.config import EngineConfig, LoRAConfig, default_max_queued_requests
from services.tokenizer.migration import migration_flags
from services.tokenizer.multimodal import media_flags


def engine_flags(config: EngineConfig) -> list[str]:
    """The child engine's command line for ``config`` (only what differs from the defaults)."""
    default = EngineConfig()
    flags: list[str] = []
    for name in EngineConfig.field_names():
        value = getattr(config, name)
        if name == "max_queued_requests":   # against the engine CLI's default, which is bounded (the config's is not)
            if value != default_max_queued_requests(config.max_num_seqs):
                flags += ["--max-queued-requests", "unbounded" if value is None else str(value)]
            continue
        if value == getattr(default, name) or name == "enforce_eager":
            continue
        if name == "enable_prefix_caching":
            flags.append("--enable-prefix-caching" if value else "--no-enable-prefix-caching")
        elif name == "disable_log_stats":
            flags.append("--disable-log-stats")
        elif name == "structured_outputs_config":   # a settings object: its flag takes JSON
            flags += ["--structured-outputs-config", json.dumps(asdict(value))]
        elif name == "lora_config":
            flags += lora_flags(value)
        elif name == "device_ids":
            flags += ["--device-ids", ",".join(map(str, value))]
        elif name == "kv_events_config":   # vLLM's JSON, every key
            flags += ["--kv-events-config", json.dumps(asdict(value))]
        elif name == "kv_offloading_config":   # vLLM's three flags
            flags += ["--kv-offloading-size", repr(value.size_gib), "--kv-offloading-backend", value.backend]
            flags += ["--kv-offloading-path", value.path] if value.path is not None else []
        elif name == "kv_transfer_config":   # vLLM's JSON
            flags += ["--kv-transfer-config", value.to_json()]
        elif name == "limit_mm_per_prompt":   # vLLM's JSON
            flags += ["--limit-mm-per-prompt", json.dumps(value)]
        elif name == "speculative_config":   # its keys as vLLM's JSON, the normalized n-gram window included
            flags += ["--speculative-config", json.dumps({k: v for k, v in asdict(value).items() if v is not None})]
        else:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def lora_flags(lora: LoRAConfig) -> list[str]:
    """The engine's LoRA flags (vLLM's) for ``lora``; each adapter in the JSON form of ``--lora-modules``."""
    flags = ["--enable-lora", "--max-loras", str(lora.max_loras), "--max-lora-rank", str(lora.max_lora_rank),
             "--lora-dtype", lora.lora_dtype]
    if lora.max_cpu_loras is not None:
        flags += ["--max-cpu-loras", str(lora.max_cpu_loras)]
    if lora.allow_runtime_lora_updating:
        flags.append("--allow-runtime-lora-updating")
    if lora.lora_modules:
        flags += ["--lora-modules", *(json.dumps(asdict(m)) for m in lora.lora_modules)]
    return flags


def tokenizer_flags(ns: argparse.Namespace) -> list[str]:
    """The tokenizer services' own flags (chat template, tool calling, reasoning, routing, migration), passed on as
    given."""
    flags = ["--chat-template", ns.chat_template] if ns.chat_template is not None else []
    if ns.enable_auto_tool_choice:
        flags.append("--enable-auto-tool-choice")
    if ns.tool_call_parser is not None:
        flags += ["--tool-call-parser", ns.tool_call_parser]
    if ns.reasoning_parser is not None:
        flags += ["--reasoning-parser", ns.reasoning_parser]
    if ns.trust_request_chat_template:
        flags.append("--trust-request-chat-template")
    if ns.routing is not None:
        flags += ["--routing", ns.routing]
    return flags + migration_flags(ns) + media_flags(ns)
