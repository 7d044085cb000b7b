"""Request plane: typed omni requests, parameters, artifacts, outputs and events.

Imports nothing else of omniloop (enforced by tests/test_layering.py).
"""

from omniloop.request.artifacts import (
    Artifact,
    AudioArtifact,
    ChunkTrajectoryArtifact,
    ImageArtifact,
    LatentsArtifact,
    TensorArtifact,
    TextArtifact,
    VideoArtifact,
    VideoChunkArtifact,
)
from omniloop.request.enums import Modality, RequestStatus, TaskType
from omniloop.request.output import (
    ArtifactEvent,
    FinalEvent,
    OmniEvent,
    OmniOutput,
    ProgressEvent,
    RequestMetrics,
    StatusEvent,
)
from omniloop.request.params import DiffusionParams, LoraRef, OutputSpec, SamplingParams
from omniloop.request.parts import (
    ActionPart,
    AudioPart,
    ImagePart,
    LatentPart,
    ModalPart,
    TextPart,
    VideoPart,
    require_prompt,
)
from omniloop.request.request import SCHEMA_VERSION, OmniRequest, new_request_id
from omniloop.request.builder import ALIASES, FieldError, Fields, build_request, generation_fields
from omniloop.request.tasks import TASK_IO, suggest_task

__all__ = [
    "ALIASES", "ActionPart", "Artifact", "ArtifactEvent", "AudioArtifact", "AudioPart", "ChunkTrajectoryArtifact", "DiffusionParams", "FieldError", "Fields", "FinalEvent",
    "ImageArtifact", "ImagePart", "LatentPart", "LatentsArtifact", "LoraRef", "Modality", "ModalPart", "OmniEvent",
    "OmniOutput", "OmniRequest", "OutputSpec", "ProgressEvent", "RequestMetrics", "RequestStatus",
    "SCHEMA_VERSION", "SamplingParams", "StatusEvent", "TASK_IO", "TaskType", "TensorArtifact", "TextArtifact", "TextPart",
    "VideoArtifact", "VideoChunkArtifact", "VideoPart", "build_request", "generation_fields", "new_request_id",
    "require_prompt", "suggest_task",
]
