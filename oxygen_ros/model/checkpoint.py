"""openpi / LeRobot pi0.5 checkpoints in safetensors: loading and saving.

Internally q/k/v and gate/up are fused; here they are split to, and joined from, the
checkpoint's per-projection tensors. ``open_checkpoint`` loads a directory as a user has it
and returns, with the model, what the directory states about the robot: cameras, dims,
horizon, normalisation and the conventions of the implementation that wrote it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ExpertConfig, ModelConfig, VisionConfig, load_config
from .lerobot_policy import PRE, is_lerobot, read_policy
from .pi05 import Pi05
from .processing import CONVENTIONS, NormStats
from .tokenizer import Tokenizer

PG = "paligemma_with_expert.paligemma."
VIT = PG + "model.vision_tower.vision_model."
LM = PG + "model.language_model."
EXP = "paligemma_with_expert.gemma_expert."
EMBED = LM + "embed_tokens.weight"
LM_HEAD = PG + "lm_head.weight"
# Present in some exports, unused by pi0.5 (the expert has no vocabulary of its own).
IGNORED = (EXP + "lm_head.weight", EXP + "model.embed_tokens.weight")

VARIANTS = {
    "gemma_2b": ExpertConfig(width=2048, depth=18, mlp=16384, heads=8, kv_heads=1, head_dim=256),
    "gemma_300m": ExpertConfig(width=1024, depth=18, mlp=4096, heads=8, kv_heads=1,
                               head_dim=256),
    "dummy": ExpertConfig(width=64, depth=4, mlp=128, heads=8, kv_heads=1, head_dim=16),
}


class CheckpointError(ValueError):
    pass


# Where a checkpoint directory may carry its SentencePiece tokenizer: as openpi names
# PaliGemma's file, as Hugging Face repositories name theirs, and where LeRobot's saved
# tokenizer step puts it (save_pretrained into tokenizer/).
TOKENIZER_FILES = ("tokenizer.model", "paligemma_tokenizer.model", "tokenizer/tokenizer.model")
PALIGEMMA_VOCAB = 257152


def _layout(cfg: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """Internal parameter name -> [(checkpoint key, rows along dim 0)], in concat order."""
    vis, ev, ee = cfg.vision, cfg.vlm, cfg.expert
    out: dict[str, list[tuple[str, int]]] = {}

    def one(name, key, rows):
        out[name] = [(key, rows)]

    for p in ("weight", "bias"):
        one(f"vision.patch.{p}", f"{VIT}embeddings.patch_embedding.{p}", vis.width)
        one(f"vision.post_ln.{p}", f"{VIT}post_layernorm.{p}", vis.width)
        one(f"projector.{p}", f"{PG}model.multi_modal_projector.linear.{p}", ev.width)
        for n, key, rows in (("action_in", "action_in_proj", ee.width),
                             ("action_out", "action_out_proj", cfg.action_dim),
                             ("time_in", "time_mlp_in", ee.width),
                             ("time_out", "time_mlp_out", ee.width),
                             ("expert_norm", "gemma_expert.model.norm.dense", 3 * ee.width)):
            prefix = "paligemma_with_expert." if key.startswith("gemma") else ""
            one(f"{n}.{p}", f"{prefix}{key}.{p}", rows)
    one("vision.pos.weight", f"{VIT}embeddings.position_embedding.weight", vis.tokens)
    for i in range(vis.depth):
        src, dst = f"vision.layers.{i}.", f"{VIT}encoder.layers.{i}."
        for p in ("weight", "bias"):
            one(f"{src}ln1.{p}", f"{dst}layer_norm1.{p}", vis.width)
            one(f"{src}ln2.{p}", f"{dst}layer_norm2.{p}", vis.width)
            one(f"{src}out.{p}", f"{dst}self_attn.out_proj.{p}", vis.width)
            one(f"{src}fc1.{p}", f"{dst}mlp.fc1.{p}", vis.mlp)
            one(f"{src}fc2.{p}", f"{dst}mlp.fc2.{p}", vis.width)
            out[f"{src}qkv.{p}"] = [(f"{dst}self_attn.{x}_proj.{p}", vis.width) for x in "qkv"]
    one("embed.weight", EMBED, cfg.vocab)
    one("vlm_norm.weight", LM + "norm.weight", ev.width)
    for tag, e, base in (("vlm", ev, LM), ("expert", ee, EXP + "model.")):
        qkv = (e.heads * e.head_dim, e.kv_heads * e.head_dim, e.kv_heads * e.head_dim)
        for i in range(e.depth):
            src, dst = f"{tag}.{i}.", f"{base}layers.{i}."
            out[src + "qkv.weight"] = [(f"{dst}self_attn.{x}_proj.weight", r)
                                       for x, r in zip("qkv", qkv, strict=True)]
            one(src + "o.weight", dst + "self_attn.o_proj.weight", e.width)
            out[src + "gate_up.weight"] = [(f"{dst}mlp.{x}_proj.weight", e.mlp)
                                           for x in ("gate", "up")]
            one(src + "down.weight", dst + "mlp.down_proj.weight", e.width)
            if tag == "vlm":
                one(src + "norm1.weight", dst + "input_layernorm.weight", e.width)
                one(src + "norm2.weight", dst + "post_attention_layernorm.weight", e.width)
            else:
                for p in ("weight", "bias"):
                    one(f"{src}norm1.{p}", f"{dst}input_layernorm.dense.{p}", 3 * e.width)
                    one(f"{src}norm2.{p}", f"{dst}post_attention_layernorm.dense.{p}",
                        3 * e.width)
    return out


def _meta_model(cfg: ModelConfig) -> Pi05:
    with torch.device("meta"):
        return Pi05(cfg)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape for a model of this config."""
    params = dict(_meta_model(cfg).named_parameters())
    shapes = {}
    for name, parts in _layout(cfg).items():
        full = tuple(params[name].shape)
        for key, rows in parts:
            shapes[key] = (rows, *full[1:])
    return shapes


def _files(path: Path) -> tuple[Path, Path | None]:
    """(weights file, directory with config.json/assets or None)."""
    if path.is_dir():
        weights = path / "model.safetensors"
        if not weights.is_file():
            found = sorted(p.name for p in path.iterdir() if p.is_file())
            raise CheckpointError(f"{path} has no model.safetensors (found: {found}); only "
                                  f"safetensors checkpoints are supported")
        return weights, path
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.suffix != ".safetensors":
        raise CheckpointError(f"refusing {path.name}: only .safetensors checkpoints are "
                              f"loaded (pickle-based .pt/.bin/.pth files can run code)")
    return path, None


def config_from_json(meta: dict, shapes: dict[str, tuple[int, ...]]) -> ModelConfig:
    if "oxygen" in meta:
        return ModelConfig.from_dict(meta["oxygen"])
    base = load_config("pi05")
    over: dict = {}
    for field, key in (("vlm", "paligemma_variant"), ("expert", "action_expert_variant")):
        name = meta.get(key)
        if name is not None:
            name = name.removesuffix("_lora")
            if name not in VARIANTS:
                raise CheckpointError(f"unknown {key} {name!r}; known: {sorted(VARIANTS)}; "
                                      f"give the dims as a model config (EngineConfig.model)")
            over[field] = VARIANTS[name]
    for key in ("action_dim", "action_horizon", "max_token_len"):
        if key in meta:
            over[key] = int(meta[key])
    return infer_config(base.replace(**over), shapes, trust_experts=bool(over))


def infer_config(base: ModelConfig, shapes: dict[str, tuple[int, ...]],
           trust_experts: bool = False) -> ModelConfig:
    """Fill dims the checkpoint's tensors reveal; head counts come from known variants."""
    def depth(prefix):
        return len({k[len(prefix):].split(".")[0] for k in shapes if k.startswith(prefix)})

    over: dict = {}
    patch = shapes.get(VIT + "embeddings.patch_embedding.weight")
    fc1 = shapes.get(VIT + "encoder.layers.0.mlp.fc1.weight")
    pos = shapes.get(VIT + "embeddings.position_embedding.weight")
    if patch and fc1 and pos:
        width, p = patch[0], patch[-1]
        heads = base.vision.heads if width == base.vision.width else None
        if heads is None:
            raise CheckpointError(f"cannot tell the vision head count for width {width}; "
                                  f"give the dims as a model config (EngineConfig.model)")
        over["vision"] = VisionConfig(width=width, depth=depth(VIT + "encoder.layers."),
                                      mlp=fc1[0], heads=heads, patch=p,
                                      image_size=int(round(pos[0] ** 0.5)) * p)
    if not trust_experts:
        for field, prefix in (("vlm", LM + "layers."), ("expert", EXP + "model.layers.")):
            gate = shapes.get(prefix + "0.mlp.gate_proj.weight")
            if gate is None:
                continue
            known = [v for v in VARIANTS.values() if v.width == gate[1] and v.mlp == gate[0]]
            if not known:
                raise CheckpointError(f"cannot tell the {field} variant (width {gate[1]}, "
                                      f"mlp {gate[0]}); give the dims as a model config "
                                      f"(EngineConfig.model)")
            over[field] = ExpertConfig(**{**known[0].__dict__, "depth": depth(prefix)})
    emb = shapes.get(EMBED) or shapes.get(LM_HEAD)
    if emb:
        over["vocab"] = emb[0]
    act = shapes.get("action_in_proj.weight")
    if act:
        over["action_dim"] = act[1]
    return base.replace(**over)


def _read_norm_stats(root: Path | None, asset_id: str | None):
    if root is None or not (root / "assets").is_dir():
        return None, None
    found = sorted(p.parent.name for p in (root / "assets").glob("*/norm_stats.json"))
    if asset_id is None:
        if not found:
            return None, None
        if len(found) > 1:
            raise CheckpointError(f"several norm stats in {root / 'assets'}: {found}; "
                                  f"pass asset_id")
        asset_id = found[0]
    path = root / "assets" / asset_id / "norm_stats.json"
    if not path.is_file():
        raise CheckpointError(f"no norm stats for asset {asset_id!r}; found: {found}")
    data = json.loads(path.read_text())
    return data.get("norm_stats", data), asset_id


def load_checkpoint(path, cfg: ModelConfig | None = None, device="cpu", dtype=None,
                    asset_id: str | None = None, overrides: dict | None = None):
    """Load a pi0.5 checkpoint: an openpi directory or a single .safetensors file.

    Returns (model, norm_stats or None, info). Keys may carry LeRobot's "model." prefix; a
    missing embed_tokens is taken from the tied lm_head. Without ``cfg`` the config comes
    from config.json (our own, or openpi's variant names) or from the tensor shapes;
    ``overrides`` replace fields of that config before the tensors are checked against it.
    """
    weights, root = _files(Path(path))
    meta = {}
    if root is not None and (root / "config.json").is_file():
        meta = json.loads((root / "config.json").read_text())
    with safe_open(str(weights), framework="pt", device="cpu") as f:
        names = {k.removeprefix("model."): k for k in f.keys()}
        found = {k: tuple(f.get_slice(src).get_shape()) for k, src in names.items()}
        if cfg is None:
            cfg = (config_from_json(meta, found) if meta
                   else infer_config(load_config("pi05"), found))
        if overrides:
            cfg = cfg.replace(**overrides)
        # The crop the weights were trained to see is theirs, like their norm stats: a config
        # given beside them must not drop or change it silently.
        stated = (meta.get("oxygen") or {}).get("image_crops") or {}
        given = cfg.to_dict()["image_crops"]
        if stated and given != stated:
            raise CheckpointError(
                f"checkpoint {weights} was trained on image crops {stated}, but config "
                f"{cfg.name!r} has {given or 'none'}: leave `model` empty to take the dims "
                f"and crops from its config.json")
        expected = expected_shapes(cfg)
        tied = EMBED not in found and LM_HEAD in found
        if tied:
            names[EMBED], found[EMBED] = names[LM_HEAD], found[LM_HEAD]
        ignored = sorted(k for k in found if k in IGNORED or (k == LM_HEAD and not tied))
        missing = sorted(set(expected) - set(found))
        extra = sorted(set(found) - set(expected) - set(ignored) - {LM_HEAD})
        wrong = sorted(f"{k} (file {list(found[k])}, model {list(expected[k])})"
                       for k in set(expected) & set(found) if found[k] != expected[k])
        if LM_HEAD in found and not tied and found[LM_HEAD] != found.get(EMBED):
            wrong.append(f"{LM_HEAD} (file {list(found[LM_HEAD])}, tied to embed_tokens "
                         f"{list(found.get(EMBED, ()))})")
        if missing or extra or wrong:
            lines = [f"checkpoint {weights} does not match config {cfg.name!r}:"]
            for label, keys in (("missing", missing), ("unexpected", extra),
                                ("wrong shape", wrong)):
                if keys:
                    lines.append(f"  {label} ({len(keys)}): " + ", ".join(keys))
            lines.append(f"  (the dims are those of config {cfg.name!r}: name the model config "
                         f"the checkpoint has as `model`, or leave `model` empty to take them "
                         f"from its config.json)")
            raise CheckpointError("\n".join(lines))
        state = {}
        for name, parts in _layout(cfg).items():
            tensors = [f.get_tensor(names[key]) for key, _ in parts]
            state[name] = tensors[0] if len(tensors) == 1 else torch.cat(tensors, 0)
    model = _meta_model(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    model.to_inference(device, dtype)
    norm_stats, asset_id = _read_norm_stats(root, asset_id)
    info = {"config": cfg, "path": str(weights), "asset_id": asset_id, "tied": tied,
            "ignored": ignored, "precision": meta.get("precision"),
            "prefixed": any(k.startswith("model.") for k in names.values())}
    return model, norm_stats, info


def _shapes(weights: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(weights), framework="pt", device="cpu") as f:
        return {k.removeprefix("model."): tuple(f.get_slice(k).get_shape()) for k in f.keys()}


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint and the facts its directory states.

    ``action_dim`` is the robot's (the columns the user gets); the model works in
    ``model.cfg.action_dim``. ``state_dim`` None: the checkpoint does not say.
    """

    model: Pi05
    norm: NormStats | None
    layout: str  # "lerobot" (a policy directory), "openpi" (directory) or "file"
    conventions: str  # see processing.CONVENTIONS
    slots: tuple[str, ...]
    state_dim: int | None
    action_dim: int
    horizon: int
    n_action_steps: int
    denoise_steps: int | None  # what the checkpoint asks for, if it says
    info: dict = dataclasses.field(default_factory=dict)


def open_checkpoint(path, dims: ModelConfig | None = None, device="cpu", dtype=None,
                    asset_id: str | None = None, normalize: bool = True,
                    conventions: str | None = None) -> Checkpoint:
    """Load a LeRobot pi05 policy directory, an openpi directory or a .safetensors file.

    ``dims``: a config whose transformer, vision and vocabulary dims are used instead of
    the variants config.json names (checked strictly against the tensors); horizon, token
    length, cameras and action width still come from the checkpoint. ``conventions``
    overrides those of the layout (LeRobot's for a policy directory, openpi's otherwise).
    Without normalisation stats this raises, naming what was looked for, unless
    ``normalize`` is False.
    """
    if conventions is not None and conventions not in CONVENTIONS:
        raise CheckpointError(f"conventions must be one of {CONVENTIONS}, got {conventions!r}")
    weights, root = _files(Path(path))
    meta = json.loads((root / "config.json").read_text()) if (
        root is not None and (root / "config.json").is_file()) else {}
    if is_lerobot(meta):
        return _open_lerobot(weights, root, meta, dims, device, dtype, normalize, conventions)
    facts = {"time_grid": conventions or "openpi"}
    if dims is not None:
        facts.update({k: int(meta[k]) for k in ("action_horizon", "max_token_len") if k in meta})
        if "image_slots" in meta.get("oxygen", {}):  # only our own files name the slots
            facts["image_slots"] = meta["oxygen"]["image_slots"]
        act = _shapes(weights).get("action_in_proj.weight")
        if act:
            facts["action_dim"] = act[1]
    model, stats, info = load_checkpoint(weights if root is None else root, dims, device, dtype,
                                         asset_id, facts)
    layout = "file" if root is None else "openpi"
    norm = None
    if normalize:
        if stats is None:
            looked = (f"{root / 'assets'}/<asset_id>/norm_stats.json" if root is not None
                      else "nothing beside a bare .safetensors file")
            raise CheckpointError(f"{path}: no normalisation stats (looked for {looked}); set "
                                  f"normalize: false to run without them on purpose")
        norm = NormStats.from_dict(stats)
        if conventions is not None:
            norm = NormStats(norm.state, norm.actions, conventions)
    cfg = model.cfg
    info = {**info, "directory": None if root is None else str(root),
            "tokenizers": [] if root is None else find_tokenizers(root)}
    # openpi's stats are computed on what the robot transforms give: the robot's dims.
    state_dim = norm.state.dim if norm is not None else None
    action_dim = min(norm.actions.dim, cfg.action_dim) if norm is not None else cfg.action_dim
    return Checkpoint(model, norm, layout, conventions or "openpi", tuple(cfg.image_slots),
                      state_dim, action_dim, cfg.action_horizon, cfg.action_horizon, None, info)


def checkpoint_slots(path, dims: ModelConfig | None = None) -> tuple[str, ...]:
    """The image slots open_checkpoint(path, dims).slots gives, from the directory's
    config files alone (no tensor is read): a LeRobot policy's cameras, the slots our own
    config.json names, else those of `dims` or of pi0.5."""
    _, root = _files(Path(path))
    meta = json.loads((root / "config.json").read_text()) if (
        root is not None and (root / "config.json").is_file()) else {}
    if is_lerobot(meta):
        return read_policy(root, meta, normalize=False).slots
    if "image_slots" in meta.get("oxygen", {}):
        return tuple(meta["oxygen"]["image_slots"])
    return tuple((dims or load_config("pi05")).image_slots)


def _open_lerobot(weights, root, meta, dims, device, dtype, normalize, conventions):
    policy = read_policy(root, meta, normalize)
    facts = dict(action_horizon=policy.horizon, max_token_len=policy.max_token_len,
                 image_slots=policy.slots, action_dim=policy.model_action_dim,
                 time_grid=conventions or "lerobot")
    cfg = dims or config_from_json({k: meta[k] for k in policy.variants}, _shapes(weights))
    model, _, info = load_checkpoint(weights, cfg.replace(**facts), device, dtype)
    size = model.cfg.vision.image_size
    if policy.image_size != (size, size):
        raise CheckpointError(f"config.json: image_resolution {list(policy.image_size)} but "
                              f"the vision tower takes {size}x{size}")
    norm = policy.norm
    if norm is not None and conventions is not None:
        norm = NormStats(norm.state, norm.actions, conventions, norm.eps)
    info = {**info, "stats_files": list(policy.stats_files), "variants": policy.variants,
            "directory": str(root), "tokenizers": find_tokenizers(root, policy.tokenizer_name),
            "tokenizer_name": policy.tokenizer_name}
    return Checkpoint(model, norm, "lerobot", conventions or "lerobot", policy.slots,
                      policy.state_dim, policy.action_dim, policy.horizon,
                      policy.n_action_steps, policy.denoise_steps, info)


def find_tokenizers(root: Path, named: str | None = None) -> list[str]:
    """The SentencePiece files a checkpoint directory carries: TOKENIZER_FILES, and
    tokenizer.model in the folder LeRobot's preprocessor names."""
    names = list(TOKENIZER_FILES)
    if named and not Path(named).is_absolute() and (root / named).is_dir():
        names.append(f"{named}/tokenizer.model")
    return [str(root / n) for n in dict.fromkeys(names) if (root / n).is_file()]


def checkpoint_tokenizer(ck: Checkpoint, path: str = "") -> tuple[Tokenizer, str]:
    """The tokenizer for checkpoint `ck` and where it came from: `path` (the tokenizer
    setting), else the one its directory carries, else the built-in tokenizer if the
    checkpoint has its vocabulary. The embedding rows are the vocabulary the model was
    trained on: ids from another tokenizer mean nothing to it, so anything else is a
    CheckpointError saying what to give, except a smaller tokenizer given as the setting
    (a vocabulary trained into the first rows of a larger embedding)."""
    vocab = ck.model.cfg.vocab
    where = ck.info.get("directory") or ck.info.get("path") or "the checkpoint"
    files = ck.info.get("tokenizers", [])
    if not path and len({Path(f).read_bytes() for f in files}) > 1:
        raise CheckpointError(f"{where} holds different tokenizers ({', '.join(files)}): "
                              f"name the one it was trained with as tokenizer")
    found = files[0] if files else None
    if path or found:
        tok = Tokenizer(path or found)
        how = "tokenizer" if path else "found in the checkpoint directory"
        # Given on purpose, a tokenizer smaller than the embedding is one whose every id the
        # model has a row for (LeRobot saves such checkpoints and runs them); sampling stays
        # within its pieces. PaliGemma's vocabulary comes with PaliGemma's tokenizer only.
        if path and tok.vocab_size < vocab != PALIGEMMA_VOCAB:
            return tok, (f"tokenizer, {tok.vocab_size} pieces for {vocab} embedding rows: "
                         f"the rows past {tok.vocab_size} are never read")
        if tok.vocab_size != vocab:
            known = " (PaliGemma's has 257152 pieces)" if vocab == PALIGEMMA_VOCAB else ""
            raise CheckpointError(f"tokenizer {tok.source} ({how}) has {tok.vocab_size} pieces "
                                  f"but {where} has a {vocab}-entry vocabulary (embedding "
                                  f"rows): give the tokenizer it was trained with{known}")
        return tok, how
    tok = Tokenizer.default()
    if tok.vocab_size == vocab:
        return tok, "built-in, of the checkpoint's vocabulary"
    raise CheckpointError(_no_tokenizer(ck, where, vocab, tok.vocab_size))


def _no_tokenizer(ck: Checkpoint, where: str, vocab: int, builtin: int) -> str:
    root = ck.info.get("directory")
    looked = f" nor in its directory ({', '.join(TOKENIZER_FILES)})" if root else ""
    if root and (Path(root) / "tokenizer").is_dir():
        looked += " (its tokenizer/ has no tokenizer.model; a tokenizer.json is not read)"
    named = ck.info.get("tokenizer_name")
    named = f"; its {PRE} names {named}" if named else ""
    kind = "PaliGemma's" if vocab == PALIGEMMA_VOCAB else "a"
    text = (f"{where} has {kind} {vocab}-entry vocabulary but no tokenizer was given "
            f"(tokenizer:){looked}, and the built-in tokenizer's {builtin} pieces would be "
            f"meaningless prompt ids to it{named}. ")
    if vocab == PALIGEMMA_VOCAB:
        text += ("Give PaliGemma's SentencePiece model as tokenizer: paligemma_tokenizer.model, "
                 "which openpi downloads from gs://big_vision/paligemma_tokenizer.model into "
                 "~/.cache/openpi/big_vision/, or tokenizer.model of the Hugging Face "
                 "repository google/paligemma-3b-pt-224, the tokenizer LeRobot's pi05 loads")
    else:
        text += f"Give the SentencePiece model it was trained with ({vocab} pieces) as tokenizer"
    if root:
        text += ", or put it in the checkpoint directory as tokenizer.model"
    return text


def _variant(e: ExpertConfig) -> str:
    return next((n for n, v in VARIANTS.items() if v == e), "custom")


def save_checkpoint(model: Pi05, path, norm_stats: dict | None = None,
                    asset_id: str = "default") -> Path:
    """Write the openpi directory layout: model.safetensors, config.json, norm stats."""
    cfg = model.cfg
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    params = dict(model.named_parameters())
    tensors = {}
    for name, parts in _layout(cfg).items():
        p = params[name].detach().cpu()
        chunks = p.split([rows for _, rows in parts], 0)
        for (key, _), t in zip(parts, chunks, strict=True):
            tensors[key] = t.contiguous()
    # openpi files carry the tied matrix once, as lm_head.
    tensors[LM_HEAD] = tensors.pop(EMBED)
    save_file(tensors, str(root / "model.safetensors"))
    precision = "bfloat16" if model.dtype == torch.bfloat16 else "float32"
    meta = {"action_dim": cfg.action_dim, "action_horizon": cfg.action_horizon,
            "max_token_len": cfg.max_token_len,
            "paligemma_variant": _variant(cfg.vlm), "action_expert_variant": _variant(cfg.expert),
            "precision": precision, "pi05": True, "oxygen": cfg.to_dict()}
    (root / "config.json").write_text(json.dumps(meta, indent=2))
    if norm_stats is not None:
        d = root / "assets" / asset_id
        d.mkdir(parents=True, exist_ok=True)
        (d / "norm_stats.json").write_text(json.dumps({"norm_stats": norm_stats}, indent=2))
    return root
