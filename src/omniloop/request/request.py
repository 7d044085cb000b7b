"""``OmniRequest``: immutable user intent."""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from omniloop.request.enums import Modality, TaskType
from omniloop.request.params import DiffusionParams, OutputSpec, SamplingParams
from omniloop.request.parts import ImagePart, ModalPart, TextPart
from omniloop.request.tasks import unknown_task

SCHEMA_VERSION = "0.1"


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


class OmniRequest(BaseModel):
    """One generation call. The task is declared, never inferred from the inputs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    request_id: str = Field(default_factory=new_request_id, min_length=1, max_length=128)
    task: TaskType
    model: str | None = Field(default=None, max_length=512,
                              description="which served model runs it (a server with several); None: the default")
    inputs: list[ModalPart] = Field(default_factory=list)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    diffusion: DiffusionParams = Field(default_factory=DiffusionParams)
    outputs: OutputSpec = Field(default_factory=OutputSpec)
    node_params: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per graph node overrides, validated against the pipeline's node schema"
    )
    priority: int = Field(default=0, ge=-100, le=100, description="higher runs first")
    deadline_s: float | None = Field(default=None, gt=0, description="soft latency target in seconds from arrival")

    @field_validator("task", mode="before")
    @classmethod
    def _known_task(cls, value: Any) -> Any:
        # the one "unknown task" message (request.tasks.unknown_task), not pydantic's enum listing
        if not isinstance(value, TaskType) and value not in {t.value for t in TaskType}:
            raise PydanticCustomError("unknown_task", "{message}", {"message": unknown_task(value)})
        return value

    # -- convenience views ------------------------------------------------------------
    @property
    def prompt(self) -> str | None:
        texts = [p.text for p in self.inputs if isinstance(p, TextPart)]
        return "\n".join(texts) if texts else None

    def images(self, role: str | None = None) -> list[ImagePart]:
        return [p for p in self.inputs if isinstance(p, ImagePart) and (role is None or p.role == role)]

    def parts(self, modality: Modality) -> list[Any]:
        return [p for p in self.inputs if p.kind == modality.value]

    @classmethod
    def text_to_video(cls, prompt: str, **kwargs: Any) -> "OmniRequest":
        return cls(task=TaskType.T2V, inputs=[TextPart(text=prompt)], **kwargs)
