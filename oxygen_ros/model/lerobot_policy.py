"""What a LeRobot pi05 policy directory states besides its weights.

``policy.save_pretrained`` writes config.json (``"type": "pi05"``, the input and output
features, chunk_size, n_action_steps, tokenizer_max_length, ...) and the processor pipelines
write policy_preprocessor.json / policy_postprocessor.json, whose normalizer steps keep their
statistics in safetensors files (keys ``observation.state.q01``, ``action.mean``, ...).
Everything that changes what LeRobot would compute is read here; settings this code does not
reproduce are refused by name rather than ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from .processing import MODES, NormStats, Stats

STATE = "observation.state"
IMAGES = "observation.images."
ACTION = "action"
PRE = "policy_preprocessor.json"
POST = "policy_postprocessor.json"
# The time embedding's periods (gemma.time_embedding); LeRobot's config may state others.
PERIODS = {"min_period": 4e-3, "max_period": 4.0}
# Processor steps that do not change the numbers at inference, as configured by pi05.
PASSIVE = {"to_batch_processor", "device_processor", "pi05_prepare_state_tokenizer_processor_step"}


class PolicyError(ValueError):
    pass


@dataclass(frozen=True)
class LeRobotPolicy:
    slots: tuple[str, ...]  # camera names, in input_features order
    image_size: tuple[int, int]
    state_dim: int
    action_dim: int
    model_action_dim: int  # max_action_dim: the width the model works in
    horizon: int
    n_action_steps: int
    max_token_len: int
    denoise_steps: int
    variants: dict[str, str]  # paligemma_variant / action_expert_variant as config.json says
    norm: NormStats | None
    stats_files: tuple[str, ...]
    # What the preprocessor's tokenizer step loads: a Hugging Face repository (e.g.
    # google/paligemma-3b-pt-224) or the folder it saved the tokenizer to; None: not said.
    tokenizer_name: str | None = None


def is_lerobot(meta: dict) -> bool:
    """LeRobot's policy configs carry their registry "type"; openpi's config.json does not."""
    return "type" in meta and "input_features" in meta


def _feature(name: str, f) -> tuple[str, list[int]]:
    if not isinstance(f, dict) or "type" not in f or "shape" not in f:
        raise PolicyError(f"feature {name!r} must have a type and a shape, got {f!r}")
    return f["type"], [int(n) for n in f["shape"]]


def _int(meta: dict, key: str) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise PolicyError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def _steps(root: Path, name: str) -> list[dict]:
    data = json.loads((root / name).read_text())
    steps = data.get("steps")
    if not isinstance(steps, list):
        raise PolicyError(f"{root / name} has no list of steps")
    return steps


def _stats_file(root: Path, step: dict, where: str) -> dict[str, dict]:
    """{feature: {stat: array}} from a normalizer step's state_file."""
    name = step.get("state_file")
    if not name:
        return {}
    path = root / name
    if not path.is_file():
        raise PolicyError(f"{where} names {name}, which is not in {root}")
    out: dict[str, dict] = {}
    with safe_open(str(path), framework="np") as f:
        for key in f.keys():
            feature, _, stat = key.rpartition(".")
            out.setdefault(feature, {})[stat] = f.get_tensor(key)
    return out


def _check_step(step: dict, where: str, meta: dict) -> None:
    reg, cfg = step.get("registry_name"), step.get("config") or {}
    if reg == "rename_observations_processor":
        if cfg.get("rename_map"):
            raise PolicyError(f"{where}: renaming observations ({cfg['rename_map']}) is not "
                              f"supported; name the cameras as the policy's features do")
    elif reg in ("relative_actions_processor", "absolute_actions_processor"):
        if cfg.get("enabled"):
            raise PolicyError(f"{where}: relative actions are not supported")
    elif reg == "tokenizer_processor":
        want = {"max_length": meta["tokenizer_max_length"], "padding_side": "right",
                "padding": "max_length"}
        bad = {k: cfg.get(k) for k, v in want.items() if cfg.get(k, v) != v}
        if bad:
            raise PolicyError(f"{where}: tokenizer settings {bad} differ from {want}")
    elif reg not in PASSIVE:
        raise PolicyError(f"{where}: processor step {reg!r} is not understood")


def _norm(root: Path, meta: dict) -> tuple[NormStats | None, list[str]]:
    """State stats from the preprocessor's normalizer, action stats from the
    postprocessor's unnormalizer, each with the mode its step states."""
    found: dict[str, tuple[dict, dict, float, str]] = {}
    files = []
    for name, kind in ((PRE, "normalizer_processor"), (POST, "unnormalizer_processor")):
        if not (root / name).is_file():
            continue
        for i, step in enumerate(_steps(root, name)):
            where = f"{name} step {i}"
            if step.get("registry_name") != kind:
                _check_step(step, where, meta)
                continue
            cfg = step.get("config") or {}
            norm_map = cfg.get("norm_map") or {}
            unknown = sorted(set(norm_map.values()) - set(MODES))
            if unknown:
                raise PolicyError(f"{where}: normalisation modes {unknown} not known "
                                  f"(known: {list(MODES)})")
            if norm_map.get("VISUAL", "IDENTITY") != "IDENTITY":
                raise PolicyError(f"{where}: normalising images ({norm_map['VISUAL']}) is not "
                                  f"supported")
            found[kind] = (_stats_file(root, step, where), norm_map,
                           float(cfg.get("eps", 1e-8)), where)
            if step.get("state_file"):
                files.append(step["state_file"])
    if "normalizer_processor" not in found or "unnormalizer_processor" not in found:
        return None, files
    stats_in, map_in, eps, where_in = found["normalizer_processor"]
    stats_out, map_out, eps_out, where_out = found["unnormalizer_processor"]
    state_mode = map_in.get("STATE", "IDENTITY")
    action_mode = map_out.get("ACTION", "IDENTITY")
    if eps_out != eps:
        raise PolicyError(f"{where_in} and {where_out} use different eps ({eps}, {eps_out})")
    state = action = None
    if state_mode != "IDENTITY":
        if STATE not in stats_in:
            return None, files
        state = Stats.from_dict(stats_in[STATE], state_mode, f"{STATE} ({where_in})")
    if action_mode != "IDENTITY":
        if ACTION not in stats_out:
            return None, files
        action = Stats.from_dict(stats_out[ACTION], action_mode, f"{ACTION} ({where_out})")
    return NormStats(state, action or Stats({}, "IDENTITY"), "lerobot", eps), files


def _tokenizer_name(root: Path) -> str | None:
    if not (root / PRE).is_file():
        return None
    for step in _steps(root, PRE):
        if step.get("registry_name") == "tokenizer_processor":
            name = (step.get("config") or {}).get("tokenizer_name")
            return name if isinstance(name, str) and name else None
    return None


def read_policy(root: Path, meta: dict, normalize: bool = True) -> LeRobotPolicy:
    """The facts of a LeRobot policy directory whose config.json is ``meta``."""
    if meta.get("type") != "pi05":
        raise PolicyError(f"{root / 'config.json'}: LeRobot policy type {meta.get('type')!r}; "
                          f"only 'pi05' is supported")
    for key, value in PERIODS.items():
        if key in meta and abs(float(meta[key]) - value) > 1e-12:
            raise PolicyError(f"config.json: {key} {meta[key]} differs from the model's {value}")
    for key, ok in (("use_relative_actions", False), ("empty_cameras", 0), ("n_obs_steps", 1)):
        if meta.get(key, ok) != ok:
            raise PolicyError(f"config.json: {key}={meta[key]!r} is not supported "
                              f"(only {ok!r})")
    slots, state_dim = [], None
    for name, f in (meta.get("input_features") or {}).items():
        kind, shape = _feature(name, f)
        if name == STATE and kind == "STATE" and len(shape) == 1:
            state_dim = shape[0]
        elif name.startswith(IMAGES) and kind == "VISUAL" and len(shape) == 3:
            slots.append(name[len(IMAGES):])
        else:
            raise PolicyError(f"config.json: input feature {name!r} ({kind}, {shape}) is not "
                              f"understood; pi05 takes {STATE} and {IMAGES}<camera>")
    if state_dim is None or not slots:
        raise PolicyError(f"config.json: input_features need {STATE} and at least one camera "
                          f"({IMAGES}<name>), got {sorted(meta.get('input_features') or {})}")
    outputs = meta.get("output_features") or {}
    if set(outputs) != {ACTION}:
        raise PolicyError(f"config.json: output_features must be just {ACTION!r}, got "
                          f"{sorted(outputs)}")
    kind, shape = _feature(ACTION, outputs[ACTION])
    if kind != "ACTION" or len(shape) != 1:
        raise PolicyError(f"config.json: {ACTION} feature must be a 1-d ACTION, got {kind} "
                          f"{shape}")
    horizon, steps = _int(meta, "chunk_size"), _int(meta, "n_action_steps")
    if steps > horizon:
        raise PolicyError(f"config.json: n_action_steps {steps} > chunk_size {horizon}")
    _int(meta, "tokenizer_max_length")
    model_dim = _int(meta, "max_action_dim")
    if shape[0] > model_dim:
        raise PolicyError(f"config.json: action dim {shape[0]} > max_action_dim {model_dim}")
    res = meta.get("image_resolution", [224, 224])
    norm, files = _norm(root, meta)
    if norm is None and normalize:
        raise PolicyError(
            f"{root} has no normalisation stats: looked for {PRE} with a "
            f"normalizer_processor step holding {STATE}.* and {POST} with an "
            f"unnormalizer_processor step holding {ACTION}.* (in their state_file "
            f"safetensors); found {sorted(p.name for p in root.iterdir())}. Set normalize: "
            f"false to run on raw state and normalised actions on purpose")
    return LeRobotPolicy(
        slots=tuple(slots), image_size=(int(res[0]), int(res[1])), state_dim=state_dim,
        action_dim=shape[0], model_action_dim=model_dim, horizon=horizon, n_action_steps=steps,
        max_token_len=meta["tokenizer_max_length"],
        denoise_steps=_int(meta, "num_inference_steps") if "num_inference_steps" in meta
        else 10,
        variants={k: meta[k] for k in ("paligemma_variant", "action_expert_variant")
                  if k in meta},
        norm=norm if normalize else None, stats_files=tuple(files),
        tokenizer_name=_tokenizer_name(root))
