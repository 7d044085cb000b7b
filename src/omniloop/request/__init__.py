"""Request plane: typed omni requests, parameters, artifacts, outputs and events.

Imports nothing else of omniloop (enforced by tests/test_layering.py).
"""

from omniloop.request.artifacts import (
    Artifact,
    AudioArtifact,
    ChunkTrajectoryArtifact,
    TrajectoryArtifact,
    ImageArtifact,
    LatentsArtifact,
    TensorArtifact,
    TextArtifact,
    TokenLogProb,
    VideoArtifact,
    VideoChunkArtifact,
)
from omniloop.request.enums import Modality, RequestStatus, TaskType
from omniloop.request.errors import (
    ErrorKind,
    Failure,
    FieldProblem,
    InvalidRequest,
    ValidationMessage,
    failure_of,
    field_problems,
    format_validation_error,
)
from omniloop.request.output import (
    ArtifactEvent,
    FinalEvent,
    OmniEvent,
    OmniOutput,
    ProgressEvent,
    RequestMetrics,
    StatusEvent,
)
from omniloop.request.params import DiffusionParams, LoopParams, LoraRef, OutputSpec, SamplingParams
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
from omniloop.request.builder import ALIASES, FieldError, Fields, KnobTable, LoopKnob, build_request, generation_fields
from omniloop.request.tasks import TASK_IO, parse_task, suggest_task

__all__ = [
    "ActionPart", "ALIASES", "Artifact", "ArtifactEvent", "AudioArtifact", "AudioPart", "build_request",
    "ChunkTrajectoryArtifact", "TrajectoryArtifact", "DiffusionParams", "ErrorKind", "Failure", "failure_of", "field_problems",
    "FieldError", "FieldProblem", "Fields", "FinalEvent", "format_validation_error", "generation_fields",
    "ImageArtifact", "ImagePart", "InvalidRequest", "KnobTable", "LatentPart", "LoopKnob", "LoopParams", "LatentsArtifact", "LoraRef", "Modality",
    "ModalPart", "new_request_id", "parse_task", "OmniEvent", "OmniOutput", "OmniRequest", "OutputSpec", "ProgressEvent",
    "RequestMetrics", "RequestStatus", "require_prompt", "SamplingParams", "SCHEMA_VERSION", "StatusEvent",
    "suggest_task", "TASK_IO", "TaskType", "TensorArtifact", "TextArtifact", "TextPart", "TokenLogProb", "ValidationMessage",
    "VideoArtifact", "VideoChunkArtifact", "VideoPart",
]
