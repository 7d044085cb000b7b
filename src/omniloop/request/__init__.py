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

__all__ = [
    "ActionPart", "Artifact", "ArtifactEvent", "AudioArtifact", "AudioPart", "ChunkTrajectoryArtifact", "DiffusionParams", "ErrorKind",
    "Failure", "FieldProblem", "FinalEvent",
    "ImageArtifact", "ImagePart", "InvalidRequest", "LatentPart", "LatentsArtifact", "LoraRef", "Modality", "ModalPart", "OmniEvent",
    "OmniOutput", "OmniRequest", "OutputSpec", "ProgressEvent", "RequestMetrics", "RequestStatus",
    "SCHEMA_VERSION", "SamplingParams", "StatusEvent", "TaskType", "TensorArtifact", "TextArtifact", "TextPart",
    "ValidationMessage", "VideoArtifact", "VideoChunkArtifact", "VideoPart", "failure_of", "field_problems",
    "format_validation_error", "new_request_id", "require_prompt",
]
