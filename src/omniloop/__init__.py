"""omniloop: a generation runtime where the runtime owns the loops.

The names most programs need are importable from here (``from omniloop import
VideoGenerator, AsyncEngine, OmniRequest, DiffusionParams``). They load on first use, so
``import omniloop`` itself stays cheap (no torch until a name is touched).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_REQUEST_TYPES = (
    "ActionPart", "ArtifactEvent", "AudioPart", "DiffusionParams", "FinalEvent", "ImagePart", "LatentPart",
    "Modality", "OmniEvent", "OmniOutput", "OmniRequest", "OutputSpec", "ProgressEvent", "RequestMetrics",
    "RequestStatus", "SamplingParams", "StatusEvent", "TaskType", "TextPart", "VideoPart",
)
# name -> the module that defines it
_LAZY: dict[str, str] = {
    "VideoGenerator": "omniloop.api.generator",
    "AsyncEngine": "omniloop.engine",
    "Engine": "omniloop.engine",
    "EngineConfig": "omniloop.engine",
    "DeployConfig": "omniloop.deploy",
    **{name: "omniloop.request" for name in _REQUEST_TYPES},
}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'omniloop' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
