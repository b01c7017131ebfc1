"""Result objects with Twinkle's field names and pydantic-style model_dump / model_dump_json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


class _Model:
    def model_dump(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    def model_dump_json(self, indent: int | None = None) -> str:
        return json.dumps(self.model_dump(), indent=indent, ensure_ascii=False)


@dataclass
class TrainingRun(_Model):
    """One adapter's training run (a run per adapter, named {session}-{adapter})."""

    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool = True
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: str | None = None
    created_time: str | None = None
    adapter_name: str | None = None
    target_modules: list[str] = field(default_factory=list)
    last_checkpoint: str | None = None
    last_sampler_checkpoint: str | None = None
    last_step: int = 0
    user_metadata: dict[str, str] = field(default_factory=dict)


@dataclass
class Checkpoint(_Model):
    """A saved checkpoint; twinkle_path is what model.load / resume_from_checkpoint take."""

    checkpoint_id: str
    checkpoint_type: str
    time: str | None
    size_bytes: int
    twinkle_path: str
    public: bool = False
    base_model: str | None = None
    is_lora: bool = True
    lora_rank: int | None = None
    training_run_id: str | None = None


@dataclass
class Cursor(_Model):
    limit: int
    offset: int
    total_count: int


@dataclass
class TrainingRunsResponse(_Model):
    training_runs: list[TrainingRun]
    cursor: Cursor
