"""Walk a MindIE config.json key by key, nested keys included: each key is mapped to its Sluice effect, accepted
with one log line saying why it has none, or refused. A key MindIE's documentation does not name is refused (Sluice
cannot tell what it would do), and every refusal is reported at once, so one run lists all there is to change."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.mindie import backend, https, schedule, server
from services.mindie.context import Context, Handler, Section
from services.mindie.outcome import KeyRefused, KeyResult, Outcome, Treatment, refused


class ConfigFileError(ValueError):
    """The file cannot be read, or keys in it are refused; the message names each key and why."""


_SERVER = Section("ServerConfig", {**server.SERVER_KEYS, **https.KEYS}, missing=https.missing)
_MODEL = Section("ModelConfig", backend.MODEL_KEYS,
                 sections={"models": Section("ModelConfig.models", backend.LAYERWISE_MODEL_KEYS)})
_BACKEND = Section("BackendConfig", backend.BACKEND_KEYS, sections={
    "kvPoolConfig": Section("BackendConfig.kvPoolConfig", backend.KV_POOL_KEYS),
    "ModelDeployConfig": Section("ModelDeployConfig", backend.DEPLOY_KEYS, lists={"ModelConfig": _MODEL}),
    "ScheduleConfig": Section("ScheduleConfig", schedule.KEYS),
})
ROOT = Section("", server.TOP_KEYS, sections={"ServerConfig": _SERVER, "BackendConfig": _BACKEND,
                                              "LogConfig": Section("LogConfig", server.LOG_KEYS)})
_UNKNOWN = ("not a key of MindIE's documented config.json (1.0.RC3 to 2.x): Sluice cannot tell what it would do, "
            "so it does not guess")


@dataclass(frozen=True)
class MindieConfig:
    """What Sluice makes of one config.json: a result per key, in the file's order."""

    results: tuple[KeyResult, ...]

    @property
    def settings(self) -> dict[str, Any]:
        """serve's settings (argparse dests) the keys set."""
        return {name: value for r in self.results if r.treatment is Treatment.EFFECT
                for name, value in r.outcome.settings.items()}

    @property
    def notes(self) -> list[str]:
        """One start-up log line per accepted key: its effect, or why it has none."""
        return [r.line for r in self.results if r.treatment is not Treatment.REFUSED]

    @property
    def refusals(self) -> list[KeyResult]:
        return [r for r in self.results if r.treatment is Treatment.REFUSED]

    def result(self, key: str) -> KeyResult:
        return next(r for r in self.results if r.key == key)


def read_mindie_config(path: str | Path, environ: Mapping[str, str] | None = None) -> MindieConfig:
    """Every key's result, refusals included; raises ConfigFileError only when the file is not a JSON object.
    Relative file paths in it are MindIE's: relative to its install folder, the parent of ``conf/``."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigFileError(f"cannot read MindIE config {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigFileError(f"{path}: the top level must be a JSON object")
    install_dir = path.resolve().parent.parent
    context = Context.of(raw, install_dir, os.environ if environ is None else environ)
    return MindieConfig(tuple(walk(ROOT, raw, context)))


def load_mindie_config(path: str | Path, environ: Mapping[str, str] | None = None) -> MindieConfig:
    """As ``read_mindie_config``; raises ConfigFileError naming every refused key and why."""
    config = read_mindie_config(path, environ)
    refusals = config.refusals
    if len(refusals) == 1:
        raise ConfigFileError(f"{refusals[0].key}: {refusals[0].outcome.message}")
    if refusals:
        raise ConfigFileError(f"{path}: {len(refusals)} MindIE keys cannot be honoured:\n" + "\n".join(
            f"  {r.key}: {r.outcome.message}" for r in refusals))
    return config


def walk(section: Section, raw: Mapping[str, Any], ctx: Context) -> Iterator[KeyResult]:
    """Each key of ``raw`` (a ``section`` object) and of the objects nested in it, then the keys it lacks."""
    for key, value in raw.items():
        name = f"{section.label}.{key}" if section.label else key
        if key in section.sections:
            if isinstance(value, dict):
                yield from walk(section.sections[key], value, ctx)
            else:
                yield KeyResult(name, refused(f"must be a JSON object, got {value!r}"))
        elif key in section.lists:
            entries = [value] if isinstance(value, dict) else value
            if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
                yield KeyResult(name, refused(f"must be a list of JSON objects, got {value!r}"))
            elif len(entries) != 1:
                yield KeyResult(name, refused(f"one model per Sluice replica (modelInstanceNumber replicas of it); "
                                              f"got {len(entries)}"))
            else:
                yield from walk(section.lists[key], entries[0], ctx)
        elif key in section.keys:
            yield KeyResult(name, _handle(section.keys[key], value, ctx))
        else:
            yield KeyResult(name, refused(_UNKNOWN))
    if section.missing is not None:
        yield from section.missing(ctx)


def _handle(handler: Handler, value: Any, ctx: Context) -> Outcome:
    try:
        return handler(value, ctx)
    except KeyRefused as e:
        return refused(str(e))
