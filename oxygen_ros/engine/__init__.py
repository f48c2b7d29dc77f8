"""The OxyGen engine: unified KV cache, shared prefill, cross-frame continuous batching."""

from ..model.rtc import Handover
from .engine import Engine, EngineConfig, FrameResult, Observation, TokenEvent
from .kv_cache import KVCache
from .requests import Request
from .scheduler import AdaptiveK, Frame, FrameOutput, Scheduler

__all__ = ['AdaptiveK', 'Engine', 'EngineConfig', 'Frame', 'FrameOutput', 'FrameResult',
           'Handover', 'KVCache', 'Observation', 'Request', 'Scheduler', 'TokenEvent']
