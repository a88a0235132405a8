"""The whole config as every key's handler sees it (a key's meaning often depends on another's), and the shape
of a section: its keys' handlers and the sections nested in it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.mindie.outcome import KeyResult, Outcome


def _object(parent: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = parent.get(name)
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class Context:
    top: Mapping[str, Any]
    server: Mapping[str, Any]
    backend: Mapping[str, Any]
    deploy: Mapping[str, Any]
    model: Mapping[str, Any]        # ModelConfig's one entry
    schedule: Mapping[str, Any]
    # MindIE's install folder ({MindIE}/latest/mindie-service, the parent of conf/config.json): its relative
    # file paths (tlsCert, tlsPk, ...) are relative to it
    install_dir: Path
    environ: Mapping[str, str]

    @classmethod
    def of(cls, raw: Mapping[str, Any], install_dir: Path, environ: Mapping[str, str]) -> Context:
        backend = _object(raw, "BackendConfig")
        deploy = _object(backend, "ModelDeployConfig")
        models = deploy.get("ModelConfig")
        model = models if isinstance(models, dict) else models[0] if (
            isinstance(models, list) and len(models) == 1 and isinstance(models[0], dict)) else {}
        return cls(raw, _object(raw, "ServerConfig"), backend, deploy, model, _object(backend, "ScheduleConfig"),
                   install_dir, environ)

    def path(self, value: str) -> Path:
        """A MindIE file path: relative to the install folder, an absolute one as it is."""
        return self.install_dir / value


# A key's handler: its value and the whole config -> what Sluice does with it (raises KeyRefused to refuse).
Handler = Callable[[Any, Context], Outcome]


def constant(outcome: Outcome) -> Handler:
    """The handler of a key whose treatment does not depend on its value."""
    return lambda value, ctx: outcome


@dataclass(frozen=True)
class Section:
    label: str                                  # its keys are named "<label>.<key>" (top level: "")
    keys: Mapping[str, Handler]
    sections: Mapping[str, Section] = field(default_factory=dict)   # nested objects
    lists: Mapping[str, Section] = field(default_factory=dict)      # lists of exactly one object (ModelConfig)
    # results for keys that must be there but are not (httpsEnabled true without tlsCert)
    missing: Callable[[Context], Iterable[KeyResult]] | None = None
