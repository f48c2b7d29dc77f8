"""The OxyGen engine: unified KV cache, shared prefill, cross-frame continuous batching."""

from ..model.rtc import Handover
from .budget import AdaptiveK
from .config import PROMPT_FORMATS, QUESTION_FORMAT, EngineConfig
from .engine import Engine
from .fleet import EveryFrame, Planner, RobotTimes
from .io import FleetResult, FrameResult, Observation, RobotInput, TokenEvent
from .kv_cache import KVCache
from .loading import random_model
from .requests import Request
from .runner import OpenFrame
from .scheduler import Frame, FrameOutput, Scheduler

__all__ = ['PROMPT_FORMATS', 'QUESTION_FORMAT', 'AdaptiveK', 'Engine', 'EngineConfig',
           'EveryFrame', 'FleetResult', 'Frame', 'FrameOutput', 'FrameResult', 'Handover',
           'KVCache', 'Observation', 'OpenFrame', 'Planner', 'Request', 'RobotInput',
           'RobotTimes', 'Scheduler', 'TokenEvent', 'random_model']
