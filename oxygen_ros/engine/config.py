"""The engine's settings: one dataclass, checked when made, read from YAML or a dict."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from ..model.processing import CONVENTIONS
from .admission import ADMISSION
from .scheduler import MODES

PROMPT_FORMATS = ('pi05', 'subtask')
# How a question follows the frame's prefix (images and task) in its request's row.
QUESTION_FORMAT = 'Question: {question}\nAnswer: '


@dataclass
class EngineConfig:
    # A built-in config name or a YAML path; '' = 'small' for random weights. With a
    # checkpoint it gives the transformer/vision/vocabulary dims instead of the variants its
    # config.json names; '' = those variants.
    model: str = ''
    checkpoint: str = ''  # LeRobot pi05 / openpi directory or .safetensors file; '' = random
    normalize: bool = True  # False: run a checkpoint without normalisation stats on purpose
    conventions: str = ''  # 'openpi' or 'lerobot'; '' = what the checkpoint directory is
    asset_id: str = ''  # openpi: which assets/<asset_id>/norm_stats.json; '' = the only one
    # SentencePiece model path; '' = a checkpoint's own (checkpoint_tokenizer), else the small
    # built-in tokenizer
    tokenizer: str = ''
    device: str = 'cpu'
    mode: str = 'oxygen'
    denoise_steps: int = 0  # 0 = the checkpoint's (LeRobot num_inference_steps), else 10
    decode_k: int = 5  # decode steps per frame; 0 = adapt to the frame budget
    control_rate_hz: float = 70.0
    frame_budget_ms: float = 0.0  # 0 = action_horizon / control_rate_hz
    max_requests: int = 8
    max_new_tokens: int = 30
    # KV columns per row for a question's own tokens; 0 = no questions (rows as small as
    # narration needs).
    max_question_tokens: int = 0
    admission: str = 'drop_oldest'
    max_pending: int = 4
    temperature: float = 0.0
    seed: int = 0
    # Each frame's flow-matching noise drawn from (seed, robot, the observation's stamp)
    # instead of one stream: the same inputs give the same chunk live and replayed.
    frame_noise: bool = False
    stop_at_eos: bool = True
    prompt_format: str = 'pi05'  # pi05: openpi's action prompt with state; subtask: OxyGen's
    threads: int = 0  # torch intra-op threads; 0 = leave torch's default
    # Run the model's phases compiled where that pays: float32 on a CPU, as AOTInductor
    # programs built once and loaded from compile_cache (engine/compiled.py). On CUDA, graphs
    # is the fast path and compile changes nothing; the parallel baseline runs eagerly.
    compile: bool = True
    compile_cache: str = ''  # '' = $OXYGEN_COMPILE_CACHE, else ~/.cache/oxygen_ros/compiled
    # Static-shape denoise and decode, captured as CUDA graphs at start-up on CUDA
    # (engine/graphs.py); elsewhere the same static calls run eagerly.
    graphs: bool = False
    phase_timing: bool = False  # CUDA: wait for the device at each phase to time it
    rtc: bool = False  # real-time chunking: guide each chunk towards the one being executed
    rtc_beta: float = 5.0  # largest guidance weight (the paper's beta); 0 = no guidance
    robots: int = 1  # most robots in one frame (step_fleet): scratch rows, denoise buckets
    robot_rows: int = 0  # KV rows one robot's requests may hold; 0 = max_requests // robots

    def __post_init__(self):
        if self.mode not in MODES + ('parallel',):
            raise ValueError(f'mode must be one of {MODES + ("parallel",)}, got {self.mode!r}')
        if self.admission not in ADMISSION:
            raise ValueError(f'admission must be one of {ADMISSION}, got {self.admission!r}')
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f'prompt_format must be one of {PROMPT_FORMATS}, '
                             f'got {self.prompt_format!r}')
        if self.max_new_tokens < 1:
            raise ValueError(f'max_new_tokens must be >= 1, got {self.max_new_tokens}')
        if self.conventions not in ('',) + CONVENTIONS:
            raise ValueError(f'conventions must be one of {CONVENTIONS} or empty, '
                             f'got {self.conventions!r}')
        for name in ('denoise_steps', 'decode_k', 'max_requests', 'threads', 'max_pending',
                     'max_question_tokens', 'robot_rows'):
            if getattr(self, name) < 0:
                raise ValueError(f'{name} must be >= 0, got {getattr(self, name)}')
        if self.control_rate_hz <= 0:
            raise ValueError(f'control_rate_hz must be > 0, got {self.control_rate_hz}')
        if self.frame_budget_ms < 0:
            raise ValueError(f'frame_budget_ms must be >= 0, got {self.frame_budget_ms}')
        if self.temperature < 0:
            raise ValueError(f'temperature must be >= 0, got {self.temperature}')
        if self.rtc_beta < 0:
            raise ValueError(f'rtc_beta must be >= 0, got {self.rtc_beta}')
        if self.robots < 1:
            raise ValueError(f'robots must be >= 1, got {self.robots}')
        if self.robots > 1 and self.mode == 'parallel':
            raise ValueError('several robots per frame need a single-copy mode, not parallel')
        if self.graphs and self.mode == 'parallel':
            raise ValueError('graphs are for the single-copy modes, not parallel')
        if self.device.startswith('cuda') and not torch.cuda.is_available():
            raise ValueError(f'device {self.device!r} asked for but CUDA is not available')

    @classmethod
    def from_dict(cls, d: dict) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f'unknown engine settings {unknown}; known: {sorted(names)}')
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str | Path) -> EngineConfig:
        with open(path) as f:
            return cls.from_dict(yaml.safe_load(f) or {})
