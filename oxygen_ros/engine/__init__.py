"""The OxyGen engine: unified KV cache, shared prefill, cross-frame continuous batching."""

from ..model.rtc import Handover
from .engine import (
    Engine,
    EngineConfig,
    FleetResult,
    FrameResult,
    Observation,
    RobotInput,
    TokenEvent,
)
from .fleet import Planner, RobotTimes
from .kv_cache import KVCache
from .requests import Request
from .scheduler import AdaptiveK, Frame, FrameOutput, Scheduler

__all__ = ['AdaptiveK', 'Engine', 'EngineConfig', 'FleetResult', 'Frame', 'FrameOutput',
           'FrameResult', 'Handover', 'KVCache', 'Observation', 'Planner', 'Request',
           'RobotInput', 'RobotTimes', 'Scheduler', 'TokenEvent']
