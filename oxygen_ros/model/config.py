"""Model dimensions for pi0.5 and smaller variants, loaded from YAML."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

CONFIG_DIR = Path(__file__).parent / "configs"
PROMPT_ATTENTION = ("bidirectional", "causal")
TIME_GRIDS = ("openpi", "lerobot")


def _check_positive(owner: str, **values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{owner}.{key} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ExpertConfig:
    """One Gemma transformer of the mixture (the VLM backbone or the action expert)."""

    width: int
    depth: int
    mlp: int
    heads: int
    kv_heads: int
    head_dim: int

    def __post_init__(self):
        _check_positive("ExpertConfig", width=self.width, depth=self.depth, mlp=self.mlp,
                        heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim)
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")


@dataclass(frozen=True)
class VisionConfig:
    """SigLIP encoder without the pooling head."""

    width: int
    depth: int
    mlp: int
    heads: int
    patch: int = 14
    image_size: int = 224

    def __post_init__(self):
        _check_positive("VisionConfig", width=self.width, depth=self.depth, mlp=self.mlp,
                        heads=self.heads, patch=self.patch, image_size=self.image_size)
        if self.width % self.heads:
            raise ValueError(f"vision width ({self.width}) must be divisible by heads "
                             f"({self.heads})")
        if self.image_size % self.patch:
            raise ValueError(f"image_size ({self.image_size}) must be a multiple of patch "
                             f"({self.patch})")

    @property
    def tokens(self) -> int:
        return (self.image_size // self.patch) ** 2


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vlm: ExpertConfig
    expert: ExpertConfig
    vision: VisionConfig
    vocab: int = 257152
    action_dim: int = 32
    action_horizon: int = 10
    max_token_len: int = 200
    image_slots: tuple[str, ...] = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
    # "bidirectional": openpi's pi0.5 prefix-LM (what released checkpoints were trained with).
    # "causal": text tokens of the prefix causal, images bidirectional (the OxyGen code).
    prompt_attention: str = "bidirectional"
    rope_base: float = 10000.0
    # Flow-matching step times (denoise.flow_times): "openpi" or "lerobot" (checkpoint-given).
    time_grid: str = "openpi"
    # Per image slot, the part of each camera image the model was trained to see, as
    # fractions (x0, y0, x1, y1) of its width and height, cut out before the resize: a policy
    # trained on a crop of the workspace must get the same crop. Given as a mapping; kept as
    # ((slot, box), ...) so the config stays immutable.
    image_crops: tuple = ()

    def __post_init__(self):
        for key, kind in (("vlm", ExpertConfig), ("expert", ExpertConfig),
                          ("vision", VisionConfig)):
            if not isinstance(getattr(self, key), kind):
                raise ValueError(f"ModelConfig.{key} must be a {kind.__name__}")
        _check_positive("ModelConfig", vocab=self.vocab, action_dim=self.action_dim,
                        action_horizon=self.action_horizon, max_token_len=self.max_token_len)
        # Attention is joint over both experts' tokens, so these must agree.
        for key in ("depth", "heads", "kv_heads", "head_dim"):
            a, b = getattr(self.vlm, key), getattr(self.expert, key)
            if a != b:
                raise ValueError(f"vlm and expert must share {key} (joint attention): "
                                 f"vlm.{key}={a}, expert.{key}={b}")
        slots = self.image_slots
        if isinstance(slots, str) or not all(isinstance(s, str) for s in slots):
            raise ValueError(f"image_slots must be a list of names, got {slots!r}")
        if not slots or len(set(slots)) != len(slots):
            raise ValueError(f"image_slots must be non-empty and unique, got {slots!r}")
        object.__setattr__(self, "image_slots", tuple(slots))
        if self.prompt_attention not in PROMPT_ATTENTION:
            raise ValueError(f"prompt_attention must be one of {PROMPT_ATTENTION}, "
                             f"got {self.prompt_attention!r}")
        object.__setattr__(self, "image_crops", _crops(self.image_crops, slots))
        if self.time_grid not in TIME_GRIDS:
            raise ValueError(f"time_grid must be one of {TIME_GRIDS}, got {self.time_grid!r}")
        if not self.rope_base > 0:
            raise ValueError(f"rope_base must be positive, got {self.rope_base!r}")
        object.__setattr__(self, "rope_base", float(self.rope_base))

    @property
    def image_tokens(self) -> int:
        return self.vision.tokens

    @property
    def prefix_len(self) -> int:
        return len(self.image_slots) * self.image_tokens + self.max_token_len

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["image_slots"] = list(self.image_slots)
        out["image_crops"] = {slot: list(box) for slot, box in self.image_crops}
        return out

    def crop_of(self, slot: str) -> tuple[float, float, float, float] | None:
        """The crop box of an image slot (fractions x0, y0, x1, y1), or None: the whole image."""
        return dict(self.image_crops).get(slot)

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        return _build(dict(data), "dict")

    def replace(self, **overrides) -> ModelConfig:
        return _build(_merge(self.to_dict(), overrides, "overrides"), "overrides")


_SUB = {"vlm": ExpertConfig, "expert": ExpertConfig, "vision": VisionConfig}


def _crops(value, slots: tuple[str, ...]) -> tuple:
    """image_crops checked: a mapping (or pairs) of known slot -> 4 fractions with
    0 <= x0 < x1 <= 1 and 0 <= y0 < y1 <= 1."""
    pairs = value.items() if isinstance(value, dict) else value
    try:
        pairs = [(slot, box) for slot, box in pairs]
    except (TypeError, ValueError):
        raise ValueError(f"image_crops must map image slots to [x0, y0, x1, y1], got "
                         f"{value!r}") from None
    out = []
    for slot, box in sorted(pairs):
        if slot not in slots:
            raise ValueError(f"image_crops names slot {slot!r}; the image slots are "
                             f"{list(slots)}")
        try:
            x0, y0, x1, y1 = (float(v) for v in box)
        except (TypeError, ValueError):
            raise ValueError(f"image_crops[{slot!r}] must be [x0, y0, x1, y1], got "
                             f"{box!r}") from None
        if not (0.0 <= x0 < x1 <= 1.0 and 0.0 <= y0 < y1 <= 1.0):
            raise ValueError(f"image_crops[{slot!r}] = {list(box)}: fractions of the image "
                             f"with 0 <= x0 < x1 <= 1 and 0 <= y0 < y1 <= 1")
        out.append((slot, (x0, y0, x1, y1)))
    return tuple(out)


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _merge(base: dict, overrides: dict, source: str) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        if key not in _fields(ModelConfig):
            raise ValueError(f"unknown config key {key!r} in {source}")
        if key in _SUB and isinstance(value, dict):
            out[key] = {**(base.get(key) or {}), **value}
        elif key in _SUB and dataclasses.is_dataclass(value):
            out[key] = dataclasses.asdict(value)
        else:
            out[key] = value
    return out


def _build(data: dict, source: str) -> ModelConfig:
    unknown = set(data) - _fields(ModelConfig)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)} in {source}")
    for key, cls in _SUB.items():
        value = data.get(key)
        if value is None:
            raise ValueError(f"config {source} lacks the {key!r} section")
        if isinstance(value, cls):
            continue
        if not isinstance(value, dict):
            raise ValueError(f"config {source}: {key!r} must be a mapping")
        bad = set(value) - _fields(cls)
        if bad:
            raise ValueError(f"unknown keys {sorted(bad)} in {key!r} of {source}")
        try:
            data[key] = cls(**value)
        except TypeError as err:
            raise ValueError(f"config {source}, section {key!r}: {err}") from None
    if "name" not in data:
        raise ValueError(f"config {source} lacks a name")
    if "image_slots" in data and isinstance(data["image_slots"], list):
        data["image_slots"] = tuple(data["image_slots"])
    return ModelConfig(**data)


def available() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def load_config(name_or_path: str | Path, **overrides) -> ModelConfig:
    """Read a config by name (configs/<name>.yaml) or path; keyword overrides take precedence.

    Overrides of vlm/expert/vision may be partial mappings, e.g. vlm={"kv_heads": 2}.
    """
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") or path.is_file()):
        path = CONFIG_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            raise ValueError(f"unknown model config {str(name_or_path)!r}; "
                             f"available: {', '.join(available())}")
    if not path.is_file():
        raise ValueError(f"config file not found: {path}")
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"config {path} must hold a mapping")
    data.setdefault("name", path.stem)
    return _build(_merge(data, overrides, "overrides"), str(path))
