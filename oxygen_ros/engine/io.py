"""What goes into the engine and what comes out: observations and robots' inputs, chunks,
language events."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..model.rtc import Handover


@dataclass
class Observation:
    stamp: float  # seconds
    images: dict  # model slot name -> HxWx3 uint8 RGB, or None when the camera is missing
    state: np.ndarray  # robot-convention state, not normalised
    prompt: str


@dataclass
class TokenEvent:
    request_id: int
    stamp: float  # observation time of the frame that started the request
    delta: str
    text: str
    tokens: int
    done: bool
    cancelled: bool = False  # ended early: cancelled, dropped or rejected
    # On the last event, why it ended (requests.REASONS); 'queued' on a question's event
    # that says it waits for a KV row.
    reason: str = ''
    message: str = ''  # the reason in words when it ended early or waits
    kind: str = 'narration'  # or 'question'
    robot: str = ''  # whose frame started the request


@dataclass
class FrameResult:
    stamp: float
    actions: np.ndarray  # [horizon, action_dim] (the robot's dims), unnormalised
    events: list[TokenEvent] = field(default_factory=list)
    timing: dict = field(default_factory=dict)
    rejected: str | None = None
    robot: str = ''


@dataclass
class RobotInput:
    """What one robot brings to a frame of several (step_fleet); as step's arguments."""

    obs: Observation
    narrate: bool = False
    max_new_tokens: int | None = None
    noise: np.ndarray | None = None
    handover: Handover | None = None


@dataclass
class FleetResult:
    """One frame of several robots. ``results``: the robots whose chunk was computed;
    ``errors``: the robots that failed, and why (their inputs, or the model on them alone);
    ``events``: every robot's language events of this frame, whether or not it was in the
    frame (requests decode across frames); a result's ``events`` is its robot's list."""

    results: dict[str, FrameResult] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    events: dict[str, list[TokenEvent]] = field(default_factory=dict)
    timing: dict = field(default_factory=dict)
