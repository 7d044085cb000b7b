"""Execution plane: Engine (sync core), AsyncEngine, StepScheduler, CostModel, admission."""

from omniloop.engine.async_engine import AsyncEngine
from omniloop.engine.engine import Engine, EngineConfig, EngineStats
from omniloop.engine.errors import (
    DoesNotFit,
    EngineDeadError,
    EngineError,
    PoolFatalError,
    QueueFull,
    RequestRejected,
    UnknownRequest,
)
from omniloop.engine.limits import LimitExceeded, check_images_per_call, check_limits
from omniloop.engine.scheduler import NodeWork, SchedulerPlan, SchedulingPolicy, StepScheduler, StepWork

__all__ = [
    "AsyncEngine", "DoesNotFit", "Engine", "EngineConfig", "EngineDeadError", "EngineError", "EngineStats",
    "LimitExceeded", "NodeWork", "PoolFatalError", "QueueFull", "RequestRejected", "SchedulerPlan", "SchedulingPolicy",
    "StepScheduler", "StepWork", "UnknownRequest", "check_images_per_call", "check_limits",
]
