"""pi0.5 in plain PyTorch with explicit prefill / denoise / decode phases."""

from .checkpoint import load_checkpoint, save_checkpoint
from .config import ExpertConfig, ModelConfig, VisionConfig, load_config
from .kv import KV
from .pi05 import Pi05

__all__ = ["KV", "ExpertConfig", "ModelConfig", "Pi05", "VisionConfig", "load_checkpoint",
           "load_config", "save_checkpoint"]
