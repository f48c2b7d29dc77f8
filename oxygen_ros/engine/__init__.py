"""The OxyGen engine: unified KV cache, shared prefill, cross-frame continuous batching."""

from .engine import Engine, EngineConfig, FrameResult, Observation, TokenEvent
from .kv_cache import KVCache
from .requests import Request
from .scheduler import AdaptiveK, Frame, FrameOutput, Scheduler

__all__ = ['AdaptiveK', 'Engine', 'EngineConfig', 'Frame', 'FrameOutput', 'FrameResult',
           'KVCache', 'Observation', 'Request', 'Scheduler', 'TokenEvent']
