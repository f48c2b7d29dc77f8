"""Numerical cross-check of oxygen_ros against LeRobot's pi0.5, model and saved policy.

Model level, on a tiny randomly initialised model (fp32, CPU, openpi's bidirectional prompt,
a batch of 3 rows: all cameras / middle camera masked / only the middle camera, with prompts
right-padded to different lengths, one not padded at all):
  1. checkpoint.py key mapping: LeRobot's state_dict, written to safetensors both in LeRobot's
     layout ("model." prefix, embed_tokens + tied lm_head) and in openpi's (no prefix, lm_head
     only), loads with our load_checkpoint(strict) and gives the same outputs;
  2. prefill: the prefix keys (after RoPE) and values of every layer at the valid columns, the
     final-normed hidden state at the last valid prefix token, and the language logits there
     (LeRobot does not expose them; computed from its PaliGemma lm_head);
  3. denoise: the velocity of one step at t=1, our uncached forward_full against it, the whole
     10-step Euler trajectory driven by LeRobot's denoise_step at our (openpi's) fp32 times,
     and LeRobot's own sample_actions (whose times are 1 + k*dt rounded from float64 instead
     of accumulated in fp32, a tiny known difference: reported, with a looser bound);
  4. decode_step: logits after two appended tokens. LeRobot's pi0.5 has no text decoding, so
     the reference steps its PaliGemma language model (the HF Gemma with its KV cache) by hand
     with OxyGen's convention (attend the valid prefix and earlier new tokens, positions
     continuing from the valid prefix count): this checks the arithmetic, not the convention;
  5. sensitivity: a causal prompt, a masked camera treated as valid, and a zeroed adaRMS
     layer must each move the results well past the tolerances, so the check can fail.
Policy level, as a user has it:
  6. LeRobot builds a tiny random PI05Policy (chunk_size 16, n_action_steps 12, 8-d state,
     7-d action, three cameras fed at 37x61, 80x50 and 56x56) and saves it with
     policy.save_pretrained plus make_pi05_pre_post_processors(...).save_pretrained, once with
     QUANTILES state and actions and once with MEAN_STD state and MIN_MAX actions, the stats
     non-trivial; its config.json names gemma_2b / gemma_300m while the tensors are tiny.
     LeRobot reloads the directory (PI05Policy.from_pretrained, PolicyProcessorPipeline.
     from_pretrained) and runs preprocessor -> predict_action_chunk(noise) -> postprocessor on
     a raw observation (uint8 images as float [0, 1] CxHxW, raw state with one value on a
     bin edge, a task); Engine(EngineConfig(checkpoint=DIR, model=DIMS_YAML, tokenizer=SPM,
     seed=0)).step(obs, noise=N) must give the same [16, 7] chunk within 1e-4, with all
     cameras and with one missing, and openpi's conventions on the same directory must not.
The fixture for CI, where LeRobot is absent (--write-fixture DIR; test/fixtures/lerobot_pi05):
  7. the policy directories of 6 as LeRobot saved them, for both stats flavours, at smaller
     dims (FIXTURE_DIMS, 1.7 MB in all), with the raw inputs (inputs.safetensors), the
     tokenizer and model dims the engine takes, and what LeRobot computed from them with all
     cameras and with wrist_left left out (expected.safetensors): the normalised state and
     prompt tokens from its preprocessor, the model's images from PI05Policy.
     _preprocess_images, the chunk from predict_action_chunk(noise) and the postprocessed
     actions; fixture.json records the versions that made it. The engine is checked against
     it as it is written (as in 6); test/reference/test_lerobot_fixture.py checks it again
     in CI. Seeded throughout: writing it again with the same versions gives the same bytes.
Not covered: bf16 (LeRobot 0.6 also keeps the whole vision tower in fp32, openpi and we only
its patch/position embeddings), the "causal" prompt flavour itself (LeRobot has none), real
pi0.5 dims or weights, relative actions and RTC (refused by the engine), and the tokenizer:
LeRobot's TokenizerProcessorStep would fetch google/paligemma-3b-pt-224 from the hub, which
is not reachable here, so it is handed the SentencePiece model the engine gets, called
through SentencePiece itself.

LeRobot's code is used unmodified. Only its plumbing is bypassed: its model needs 8 query
heads (it hard-codes the attention reshape) and takes Gemma variants by name, so the tiny
dims are injected by wrapping the constructors it calls; lerobot.policies' __init__ (which
imports every policy) is skipped; torchvision, which only LeRobot's training transforms use
and whose PyPI build does not load against the CPU torch here, is a stub; and on Python 3.11
(lerobot>=0.5 declares 3.12) the PEP 695 type-parameter lists of a few LeRobot modules, which
only feed annotations, are rewritten at import into TypeVars and typing.Generic.

Run it in a separate environment, never the project's venv:
    python3 -m venv /tmp/xcheck-venv
    /tmp/xcheck-venv/bin/pip install torch==2.13.0
    /tmp/xcheck-venv/bin/pip install --no-deps --ignore-requires-python lerobot==0.6.1
    /tmp/xcheck-venv/bin/pip install 'transformers==5.5.4' 'draccus>=0.11.6,<0.12' \
        'torch==2.13.0' sentencepiece einops gymnasium
    PYTHONPATH=. OMP_NUM_THREADS=1 /tmp/xcheck-venv/bin/python \
        tools/crosscheck_lerobot.py [--write-fixture test/fixtures/lerobot_pi05]
(--no-deps also skips LeRobot's torch<2.12 pin; nothing used here depends on it. Checked with
lerobot 0.6.1, transformers 5.5.4, torch 2.13.0+cpu, Python 3.11; about 10 s on one core.)
Exits 0 when every difference is within its tolerance, 1 otherwise. Not a pytest test.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import re
import sys
import tempfile
import types
from pathlib import Path
from types import SimpleNamespace

import torch

torch.set_num_threads(1)

# --------------------------------------------------------------------------- LeRobot import


class _AnyModule(types.ModuleType):
    """A stub whose every attribute is a do-nothing class."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        cls = type(name, (), {"__init__": lambda self, *a, **k: None})
        setattr(self, name, cls)
        return cls


# PEP 695 type parameters (Python 3.12 syntax): `class C[T, U](B):`, `def f[T: X](`, `type A =`.
_TYPE_PARAMS = re.compile(r"^(\s*)(class|def) (\w+)\[([^\]]*)\](\(?)", re.M)
_TYPE_ALIAS = re.compile(r"^type (\w+) *=", re.M)


def _down_level(src: str) -> str:
    """The same module in Python 3.11 syntax: type parameters become module-level TypeVars
    (a class keeps them through typing.Generic); they only ever feed annotations."""
    names: set[str] = set()

    def strip(m):
        params = [p.split(":")[0].strip() for p in m.group(4).split(",")]
        names.update(params)
        if m.group(2) == "def":
            return f"{m.group(1)}def {m.group(3)}{m.group(5)}"
        generic = f"_Generic[{', '.join(params)}]"
        return f"{m.group(1)}class {m.group(3)}({generic}" + (", " if m.group(5) else ")")

    out = _TYPE_PARAMS.sub(strip, src)
    out = _TYPE_ALIAS.sub(r"\1 =", out)
    if out == src:
        return src
    head = "from typing import Generic as _Generic, TypeVar as _TypeVar\n" + "".join(
        f"{n} = _TypeVar({n!r})\n" for n in sorted(names))
    future = re.search(r"^from __future__ import annotations\n", out, re.M)
    at = future.end() if future else 0
    return out[:at] + head + out[at:]


class _Py311Loader(importlib.machinery.SourceFileLoader):
    def source_to_code(self, data, path, *, _optimize=-1):
        return compile(_down_level(data.decode()), path, "exec", dont_inherit=True,
                       optimize=_optimize)


class _LeRobotFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] != "lerobot":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and str(spec.origin).endswith(".py"):
            spec.loader = _Py311Loader(name, spec.origin)
        return spec


def import_lerobot():
    """LeRobot's pi05 modelling, config and processor modules, as installed."""
    spec = importlib.util.find_spec("lerobot")
    if spec is None:
        sys.exit("lerobot is not installed in this interpreter; see the module docstring")
    root = Path(spec.submodule_search_locations[0])
    import transformers  # noqa: F401  (before the torchvision stub: it probes for it)
    for name in ("torchvision", "torchvision.io", "torchvision.models", "torchvision.transforms",
                 "torchvision.transforms.v2", "torchvision.transforms.functional"):
        module = _AnyModule(name)
        module.__path__ = []
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    if sys.version_info < (3, 12):
        sys.meta_path.insert(0, _LeRobotFinder())
    import lerobot
    policies = types.ModuleType("lerobot.policies")  # its __init__ imports every policy
    policies.__path__ = [str(root / "policies")]
    sys.modules["lerobot.policies"] = policies
    from lerobot.policies import pi_gemma
    from lerobot.policies.pi05 import modeling_pi05
    return modeling_pi05, pi_gemma, getattr(lerobot, "__version__", "?")


# --------------------------------------------------------------------------- dimensions

VOCAB = 1024
VLM = dict(width=64, depth=4, mlp=128, heads=8, kv_heads=1, head_dim=16)  # openpi "dummy"
EXPERT = dict(width=32, depth=4, mlp=64, heads=8, kv_heads=1, head_dim=16)  # narrower
VISION = dict(width=32, depth=2, mlp=64, heads=2, patch=14, image_size=56)
DIMS = dict(vlm=VLM, expert=EXPERT, vision=VISION, vocab=VOCAB)
# The committed fixture holds two whole policy directories in under 2 MB: half the layers,
# head_dim 8 (LeRobot still needs 8 query heads) and the built-in tokenizer's 512 pieces.
FIXTURE_DIMS = dict(
    vlm=dict(width=48, depth=2, mlp=96, heads=8, kv_heads=1, head_dim=8),
    expert=dict(width=32, depth=2, mlp=64, heads=8, kv_heads=1, head_dim=8),
    vision=dict(width=32, depth=2, mlp=64, heads=2, patch=14, image_size=56), vocab=512)
ACTION_DIM, HORIZON, MAX_TOKENS, STEPS = 32, 10, 24, 10


def our_config():
    from oxygen_ros.model import load_config
    return load_config("tiny", name="xcheck", vlm=VLM, expert=EXPERT, vision=VISION,
                       vocab=VOCAB, action_dim=ACTION_DIM, action_horizon=HORIZON,
                       max_token_len=MAX_TOKENS, prompt_attention="bidirectional")


def tiny_variants(m, pg, dims: dict = DIMS):
    """Make LeRobot build the tiny dims under the variant names its config accepts."""
    variants = {"gemma_2b": dims["vlm"], "gemma_300m": dims["expert"]}
    vision, vocab = dims["vision"], dims["vocab"]

    def get_gemma_config(name):
        v = variants[name]
        return m.GemmaConfig(width=v["width"], depth=v["depth"], mlp_dim=v["mlp"],
                             num_heads=v["heads"], num_kv_heads=v["kv_heads"],
                             head_dim=v["head_dim"])

    def paligemma(config):
        config.text_config.vocab_size = vocab
        vc = config.vision_config
        vc.hidden_size, vc.num_hidden_layers = vision["width"], vision["depth"]
        vc.intermediate_size, vc.num_attention_heads = vision["mlp"], vision["heads"]
        vc.patch_size, vc.image_size = vision["patch"], vision["image_size"]
        vc.projection_dim = config.projection_dim = variants["gemma_2b"]["width"]
        return pg.PaliGemmaForConditionalGenerationWithPiGemma(config)

    def expert(config):
        config.vocab_size = vocab
        return pg.PiGemmaForCausalLM(config)

    m.get_gemma_config = get_gemma_config
    m.PaliGemmaForConditionalGenerationWithPiGemma = paligemma
    m.PiGemmaForCausalLM = expert


def build_lerobot(m):
    """PI05Pytorch with the tiny dims, constructed through LeRobot's own code path."""
    cfg = SimpleNamespace(
        paligemma_variant="gemma_2b", action_expert_variant="gemma_300m",
        image_resolution=(VISION["image_size"],) * 2, dtype="float32",
        freeze_vision_encoder=False, train_expert_only=False, max_action_dim=ACTION_DIM,
        chunk_size=HORIZON, n_action_steps=HORIZON, num_inference_steps=STEPS,
        min_period=4e-3, max_period=4.0, compile_model=False, rtc_config=None,
        time_sampling_beta_alpha=1.5, time_sampling_beta_beta=1.0,
        time_sampling_scale=0.999, time_sampling_offset=0.001)
    return m.PI05Pytorch(cfg).eval()


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int = 0):
    """Replace every parameter with seeded values of O(1) effect, so that nothing that is
    zero-initialised (adaRMS dense layers, norm offsets, biases) drops out of the check."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if "embed_tokens" in name or "lm_head" in name:
            p.copy_(noise / p.shape[-1] ** 0.5)
        elif "position_embedding" in name:
            p.copy_(0.5 * noise)
        elif p.ndim >= 2:
            fan_in = p[0].numel()
            p.copy_(noise / fan_in ** 0.5)
        elif "layer_norm" in name or "post_layernorm" in name:
            p.copy_((1.0 + 0.2 * noise) if name.endswith("weight") else 0.2 * noise)
        else:  # Gemma norm offsets (stored as 1 + w) and biases
            p.copy_(0.2 * noise)
    # pi0.5 ties the LM head to the token embedding; LeRobot restores the tie on load by
    # copying lm_head into embed_tokens (openpi files hold lm_head only).
    pali = model.paligemma_with_expert.paligemma
    pali.model.language_model.embed_tokens.weight.copy_(pali.lm_head.weight)


def export(model: torch.nn.Module, directory: Path) -> dict[str, Path]:
    """The state dict in LeRobot's saved layout and in openpi's."""
    from safetensors.torch import save_file
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    embed = "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
    head = "paligemma_with_expert.paligemma.lm_head.weight"
    if not torch.equal(sd[embed], sd[head]):
        raise SystemExit("LeRobot's lm_head is not tied to embed_tokens")
    out = {}
    out["lerobot"] = directory / "lerobot.safetensors"
    save_file({f"model.{k}": v for k, v in sd.items()}, str(out["lerobot"]))
    openpi = {k: v for k, v in sd.items() if k != embed}
    out["openpi"] = directory / "openpi.safetensors"
    save_file(openpi, str(out["openpi"]))
    return out


# --------------------------------------------------------------------------- inputs


def make_inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    b, s, size = 3, 3, VISION["image_size"]
    images = torch.rand(b, s, 3, size, size, generator=g) * 2 - 1
    # all cameras; the middle one missing; only the middle one (and a prompt without padding)
    image_mask = torch.tensor([[True, True, True], [True, False, True], [False, True, False]])
    images[~image_mask] = 0.0  # a missing camera arrives as a masked zero image
    lengths = torch.tensor([9, 17, MAX_TOKENS])
    tokens = torch.randint(2, VOCAB, (b, MAX_TOKENS), generator=g)
    token_mask = torch.arange(MAX_TOKENS)[None] < lengths[:, None]
    tokens[~token_mask] = 0
    noise = torch.randn(b, HORIZON, ACTION_DIM, generator=g)
    decoded = torch.randint(2, VOCAB, (b, 2), generator=g)
    return images, image_mask, tokens, token_mask, noise, decoded


# --------------------------------------------------------------------------- comparison


class Report:
    def __init__(self):
        self.rows, self.failed = [], False

    def add(self, what, ours, ref, tol):
        ours, ref = ours.double(), ref.double()
        if ours.shape != ref.shape:
            raise SystemExit(f"{what}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}")
        diff = (ours - ref).abs().max().item()
        scale = ref.abs().max().item()
        ok = diff <= tol
        self.failed |= not ok
        self.rows.append(f"{'ok  ' if ok else 'FAIL'} {what:62s} max|diff| {diff:.3e} "
                         f"(max|ref| {scale:.2e}, tol {tol:.0e})")

    def differs(self, what, ours, ref, floor):
        """A deliberately broken variant must move the result by more than ``floor``."""
        diff = (ours.double() - ref.double()).abs().max().item()
        ok = diff > floor
        self.failed |= not ok
        self.rows.append(f"{'ok  ' if ok else 'FAIL'} sensitivity: {what:49s} max|diff| "
                         f"{diff:.3e} (must exceed {floor:.0e})")

    def print(self):
        print("\n".join(self.rows))


@torch.no_grad()
def lerobot_reference(m, model, images, image_mask, tokens, token_mask, noise, decoded, times,
                      dt):
    """LeRobot's prefill, first velocity, trajectory at the given times, sample_actions, and
    logits after each of the ``decoded`` tokens [B, G]."""
    imgs = list(images.unbind(1))
    masks = list(image_mask.unbind(1))
    pwe = model.paligemma_with_expert
    embs, pad, att = model.embed_prefix(imgs, masks, tokens, token_mask)
    att4 = m.prepare_attention_masks_4d(m.make_att_2d_masks(pad, att))
    pwe.paligemma.model.language_model.config._attn_implementation = "eager"
    (hidden, _), cache = pwe.forward(attention_mask=att4, position_ids=pad.cumsum(1) - 1,
                                     past_key_values=None, inputs_embeds=[embs, None],
                                     use_cache=True)
    last = (pad * torch.arange(1, pad.shape[1] + 1)).argmax(1)
    h_last = hidden[torch.arange(hidden.shape[0]), last]
    kv = [(k, v) for k, v, *_ in cache]
    out = {"pad": pad, "kv": kv, "hidden": h_last,
           "logits": pwe.paligemma.lm_head(h_last).float()}

    # Text decoding is not part of LeRobot's pi0.5; this steps its PaliGemma language model
    # by hand with the convention OxyGen decodes with: each new token attends to the valid
    # prefix and the earlier new tokens, at positions continuing from the valid prefix count.
    lm = pwe.paligemma.model.language_model
    dec_cache = m.clone_past_key_values(cache)
    out["decode"] = []
    for j in range(decoded.shape[1]):
        seen = torch.cat((pad, torch.ones(pad.shape[0], j + 1, dtype=torch.bool)), 1)
        step = lm.forward(inputs_embeds=lm.get_input_embeddings()(decoded[:, j:j + 1]),
                          attention_mask=m.prepare_attention_masks_4d(seen[:, None, :]),
                          position_ids=pad.sum(1, keepdim=True) + j,
                          past_key_values=dec_cache, use_cache=True)
        out["decode"].append(pwe.paligemma.lm_head(step.last_hidden_state[:, 0]).float())

    def velocity(x, t):
        tt = torch.full((x.shape[0],), t, dtype=torch.float32)
        return model.denoise_step(prefix_pad_masks=pad, past_key_values=cache, x_t=x,
                                  timestep=tt)

    out["v1"] = velocity(noise, 1.0)
    x, vs = noise, []
    for t in times:
        vs.append(velocity(x, t))
        x = x + dt * vs[-1]
    out["trajectory"], out["velocities"] = x, vs
    out["sample_actions"] = model.sample_actions(imgs, masks, tokens, token_mask,
                                                 noise=noise.clone(), num_steps=STEPS)
    return out


@torch.no_grad()
def ours(model, images, image_mask, tokens, token_mask, noise, decoded):
    from oxygen_ros.model import KV
    cfg = model.cfg
    kv = KV.allocate(cfg, rows=images.shape[0], max_len=cfg.prefix_len + decoded.shape[1])
    hidden = model.prefill(images, image_mask, tokens, token_mask, kv, slice(None))
    # Keys and values of the valid prefix columns, in order, before decoding appends any.
    valid = [kv.valid[r, :kv.length[r]].clone() for r in range(kv.rows)]
    prefix_kv = [(torch.cat([kv.k[i][r, :, :len(c)][:, c] for r, c in enumerate(valid)], 1),
                  torch.cat([kv.v[i][r, :, :len(c)][:, c] for r, c in enumerate(valid)], 1))
                 for i in range(kv.depth)]
    out = {"kv": prefix_kv, "hidden": hidden, "logits": model.logits(hidden)}
    trace1: list = []
    model.denoise(kv, slice(None), noise, steps=1, trace=trace1)
    out["v1"] = trace1[0]
    out["v1_full"] = model.forward_full(images, image_mask, tokens, token_mask, noise, 1.0)
    trace: list = []
    out["actions"] = model.denoise(kv, slice(None), noise, steps=STEPS, trace=trace)
    out["velocities"] = trace
    rows = torch.arange(images.shape[0])
    out["decode"] = [model.decode_step(kv, rows, decoded[:, j])
                     for j in range(decoded.shape[1])]
    return out


def compare(report, tag, mine, ref):
    pad = ref["pad"]
    for layer, ((k, v), (k_ref, v_ref)) in enumerate(zip(mine["kv"], ref["kv"], strict=True)):
        # LeRobot's cache holds every column of [cameras | max_token_len]; ours packs present
        # cameras to the front, so compare the valid columns of each row, in order.
        k_ref = torch.cat([k_ref[r][:, pad[r]] for r in range(pad.shape[0])], 1)
        v_ref = torch.cat([v_ref[r][:, pad[r]] for r in range(pad.shape[0])], 1)
        report.add(f"[{tag}] prefix keys (RoPE'd), layer {layer}, valid cols", k, k_ref, 1e-4)
        report.add(f"[{tag}] prefix values, layer {layer}, valid cols", v, v_ref, 1e-4)
    report.add(f"[{tag}] final-normed hidden at last valid prefix token",
               mine["hidden"], ref["hidden"], 1e-4)
    report.add(f"[{tag}] language logits at last valid prefix token",
               mine["logits"], ref["logits"], 1e-4)
    report.add(f"[{tag}] velocity, one denoise step at t=1 (cached)", mine["v1"], ref["v1"],
               1e-4)
    report.add(f"[{tag}] velocity at t=1, our uncached forward_full", mine["v1_full"],
               ref["v1"], 1e-4)
    worst = max(range(STEPS), key=lambda i: (mine["velocities"][i]
                                             - ref["velocities"][i]).abs().max().item())
    report.add(f"[{tag}] velocity, worst of {STEPS} steps (step {worst})",
               mine["velocities"][worst], ref["velocities"][worst], 1e-4)
    report.add(f"[{tag}] actions after {STEPS} steps, same fp32 times",
               mine["actions"], ref["trajectory"], 1e-4)
    report.add(f"[{tag}] actions vs LeRobot sample_actions (1+k*dt times)",
               mine["actions"], ref["sample_actions"], 1e-3)
    for j, (a, r) in enumerate(zip(mine["decode"], ref["decode"], strict=True)):
        report.add(f"[{tag}] logits after decoded token {j} (hand-stepped HF Gemma)", a, r,
                   1e-4)


# --------------------------------------------------------------------------- policy directory

CAMERAS = {"top": (37, 61), "wrist_left": (80, 50), "side": (56, 56)}  # H, W as fed
STATE_DIM, ACTION_DIM_ROBOT, CHUNK, N_ACTION_STEPS, POLICY_TOKENS = 8, 7, 16, 12, 64
NORM_MAPS = {"quantiles": {"STATE": "QUANTILES", "ACTION": "QUANTILES"},
             "mean_std/min_max": {"STATE": "MEAN_STD", "ACTION": "MIN_MAX"}}


class SentencePieceTokenizer:
    """The call LeRobot's TokenizerProcessorStep makes of a Hugging Face tokenizer, served by
    SentencePiece itself: LeRobot would fetch google/paligemma-3b-pt-224 from the hub, which
    cannot be reached here, so the same model file the engine gets stands in for it."""

    def __init__(self, path: Path):
        import sentencepiece
        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))

    def __call__(self, text, max_length, truncation=True, padding="max_length",
                 padding_side="right", return_tensors="pt"):
        if (padding, padding_side, return_tensors) != ("max_length", "right", "pt"):
            raise SystemExit(f"unexpected tokenizer call {padding} {padding_side}")
        texts = [text] if isinstance(text, str) else list(text)
        ids = torch.zeros(len(texts), max_length, dtype=torch.long)
        mask = torch.zeros(len(texts), max_length, dtype=torch.long)
        for row, t in enumerate(texts):
            pieces = self.sp.encode(t, add_bos=True)
            if truncation:
                pieces = pieces[:max_length]
            ids[row, :len(pieces)] = torch.tensor(pieces)
            mask[row, :len(pieces)] = 1
        return {"input_ids": ids, "attention_mask": mask}


def policy_stats(seed: int = 3) -> dict:
    """Dataset statistics of every kind LeRobot keeps, none trivial."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, n in (("observation.state", STATE_DIM), ("action", ACTION_DIM_ROBOT)):
        centre = torch.randn(n, generator=g) * 2
        spread = torch.rand(n, generator=g) * 3 + 0.5
        out[key] = {"mean": centre, "std": spread, "q01": centre - 1.5 * spread,
                    "q99": centre + 2.0 * spread, "min": centre - 3 * spread,
                    "max": centre + 4 * spread}
    return out


def save_policy(m, directory: Path, norm_map: dict, size: int = VISION["image_size"]) -> None:
    """A tiny random PI05Policy saved as LeRobot saves one: save_pretrained plus its pre-
    and post-processors (the stats go into their safetensors files)."""
    from lerobot.configs import FeatureType, NormalizationMode, PolicyFeature
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.processor_pi05 import make_pi05_pre_post_processors
    features = {f"observation.images.{c}": PolicyFeature(FeatureType.VISUAL, (3, size, size))
                for c in CAMERAS}
    features["observation.state"] = PolicyFeature(FeatureType.STATE, (STATE_DIM,))
    cfg = PI05Config(
        input_features=features,
        output_features={"action": PolicyFeature(FeatureType.ACTION, (ACTION_DIM_ROBOT,))},
        chunk_size=CHUNK, n_action_steps=N_ACTION_STEPS, image_resolution=(size, size),
        tokenizer_max_length=POLICY_TOKENS, device="cpu",
        normalization_mapping={"VISUAL": NormalizationMode.IDENTITY,
                               **{k: NormalizationMode(v) for k, v in norm_map.items()}})
    policy = m.PI05Policy(cfg)
    randomise(policy.model)
    pre, post = make_pi05_pre_post_processors(cfg, policy_stats())
    policy.save_pretrained(directory)
    pre.save_pretrained(directory)
    post.save_pretrained(directory)


def raw_observation(seed: int, stats: dict):
    """Images of odd sizes (uint8 HxWx3), a raw state spread over and past the stats' range,
    one value exactly at q01 (the edge of bin 0), and a task."""
    g = torch.Generator().manual_seed(seed)
    images = {c: torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
              for c, (h, w) in CAMERAS.items()}
    st = stats["observation.state"]
    state = st["q01"] + (st["q99"] - st["q01"]) * (torch.rand(STATE_DIM, generator=g) * 1.4 - 0.2)
    state[2] = st["q01"][2]
    return images, state.numpy().astype("float32"), "pick up the red cube_and place it"


@torch.no_grad()
def lerobot_policy_stages(m, directory: Path, images, state, task, noise) -> dict:
    """LeRobot's own path on the saved directory: preprocessor -> predict_action_chunk ->
    postprocessor, with what each stage hands on: the normalised state and prompt tokens
    (preprocessor), the model's images ({camera: 3xHxW in [-1, 1]}, present ones only), the
    chunk in model space and the final actions."""
    from lerobot.processor import PolicyProcessorPipeline
    from lerobot.processor.converters import (
        batch_to_transition,
        policy_action_to_transition,
        transition_to_batch,
        transition_to_policy_action,
    )
    policy = m.PI05Policy.from_pretrained(directory).eval()
    pre = PolicyProcessorPipeline.from_pretrained(
        directory, config_filename="policy_preprocessor.json",
        to_transition=batch_to_transition, to_output=transition_to_batch)
    post = PolicyProcessorPipeline.from_pretrained(
        directory, config_filename="policy_postprocessor.json",
        to_transition=policy_action_to_transition, to_output=transition_to_policy_action)
    batch = {f"observation.images.{c}": torch.from_numpy(img).permute(2, 0, 1).float() / 255
             for c, img in images.items()}
    batch["observation.state"] = torch.from_numpy(state)
    batch["task"] = task
    ready = pre(batch)
    # _preprocess_images lists the present cameras first, in feature order, then the missing.
    present = [c for c in CAMERAS if c in images]
    model_images, _ = policy._preprocess_images(ready)
    chunk = policy.predict_action_chunk(ready, noise=torch.from_numpy(noise)[None])
    return {"state": ready["observation.state"][0],
            "tokens": ready["observation.language.tokens"][0],
            "token_mask": ready["observation.language.attention_mask"][0].bool(),
            "images": {c: img[0] for c, img in zip(present, model_images, strict=False)},
            "chunk": chunk[0], "actions": post(chunk)[0]}


def lerobot_policy_actions(m, directory: Path, images, state, task, noise):
    return lerobot_policy_stages(m, directory, images, state, task, noise)["actions"]


def our_policy_actions(directory: Path, dims: Path, tokenizer: Path, images, state, task,
                       noise, **engine):
    import numpy as np

    from oxygen_ros.engine import Engine, EngineConfig, Observation
    eng = Engine(EngineConfig(checkpoint=str(directory), model=str(dims),
                              tokenizer=str(tokenizer), seed=0, **engine))
    facts = (eng.slots, eng.state_dim, eng.action_dim, eng.action_horizon, eng.n_action_steps)
    want = (tuple(CAMERAS), STATE_DIM, ACTION_DIM_ROBOT, CHUNK, N_ACTION_STEPS)
    if facts != want:
        raise SystemExit(f"engine facts {facts} != the policy's {want}")
    out = eng.step(Observation(0.0, images, state, task), noise=noise).actions
    return torch.from_numpy(np.asarray(out))


def use_sentencepiece(tokenizer: Path) -> None:
    """Write the engine's built-in SentencePiece model to ``tokenizer`` and have LeRobot's
    TokenizerProcessorStep tokenize with it."""
    from oxygen_ros.model.tokenizer import Tokenizer
    tokenizer.write_bytes(Tokenizer.default().model_proto())
    import lerobot.processor.tokenizer_processor as tp

    class _Hub:
        @staticmethod
        def from_pretrained(name, **kw):
            return SentencePieceTokenizer(tokenizer)

    tp.AutoTokenizer = _Hub


def write_dims(path: Path, dims: dict) -> None:
    import yaml
    path.write_text(yaml.safe_dump(dict(name="xcheck", **dims)))


def check_policy_directory(m, report: Report, tmp: Path) -> None:
    """The engine on directories LeRobot saved, against LeRobot's full pipeline."""
    tokenizer = tmp / "tokenizer.model"
    use_sentencepiece(tokenizer)
    dims = tmp / "dims.yaml"
    write_dims(dims, DIMS)
    stats = policy_stats()
    for tag, norm_map in NORM_MAPS.items():
        directory = tmp / f"policy_{tag.replace('/', '_')}"
        save_policy(m, directory, norm_map)
        meta = json.loads((directory / "config.json").read_text())
        if meta["paligemma_variant"] != "gemma_2b":
            raise SystemExit("expected the saved config to name variants its tensors lack")
        for case, missing in (("all cameras", None), ("camera wrist_left missing",
                                                      "wrist_left")):
            images, state, task = raw_observation(5, stats)
            if missing:
                del images[missing]
            g = torch.Generator().manual_seed(9)
            noise = torch.randn(CHUNK, ACTION_DIM, generator=g).numpy()
            ref = lerobot_policy_actions(m, directory, images, state, task, noise)
            mine = our_policy_actions(directory, dims, tokenizer, images, state, task, noise)
            report.add(f"[policy {tag}] final actions [{CHUNK}x{ACTION_DIM_ROBOT}], {case}",
                       mine, ref, 1e-4)
        if tag == "quantiles":
            report.differs("policy: openpi conventions instead of LeRobot's -> actions",
                           our_policy_actions(directory, dims, tokenizer, images, state, task,
                                              noise, conventions="openpi"), ref, 1e-3)


# --------------------------------------------------------------------------- fixture

FIXTURE_LIMIT = 2_000_000  # bytes, the whole fixture
CASES = {"all": (), "no_wrist_left": ("wrist_left",)}  # case -> cameras left out


def versions(lerobot_version: str) -> dict:
    from importlib.metadata import version

    import transformers
    out = {"lerobot": lerobot_version, "transformers": transformers.__version__,
           "torch": torch.__version__, "python": sys.version.split()[0]}
    for name in ("numpy", "safetensors", "sentencepiece", "draccus"):
        out[name] = version(name)
    return out


def plain(t):
    """A tensor as a C-ordered array: safetensors.numpy writes an array's buffer as it lies
    in memory, so a strided view (a permute, a slice of the last dim) would come out
    scrambled."""
    import numpy as np
    return np.ascontiguousarray(t.numpy() if isinstance(t, torch.Tensor) else t)


def write_fixture(m, pg, out: Path, lerobot_version: str) -> int:
    """What test/reference/test_lerobot_fixture.py checks the engine against with LeRobot
    absent: two tiny policy directories as LeRobot saved them (one per NORM_MAPS flavour, the same
    weights), the raw inputs and noise, and what LeRobot computed from them at each stage,
    with every camera and with one left out. The engine is checked against it here too."""
    import shutil

    import numpy as np
    from safetensors.numpy import save_file

    if out.exists() and any(out.iterdir()) and not (out / "fixture.json").is_file():
        raise SystemExit(f"{out} holds other files; give an empty or a fixture directory")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    tiny_variants(m, pg, FIXTURE_DIMS)
    tokenizer, dims = out / "tokenizer.model", out / "dims.yaml"
    use_sentencepiece(tokenizer)
    write_dims(dims, FIXTURE_DIMS)
    stats = policy_stats()
    images, state, task = raw_observation(5, stats)
    noise = torch.randn(CHUNK, ACTION_DIM, generator=torch.Generator().manual_seed(9)).numpy()
    inputs = {f"image.{c}": plain(img) for c, img in images.items()}
    inputs.update(state=plain(state), noise=plain(noise))
    save_file(inputs, str(out / "inputs.safetensors"))

    report, expected, policies = Report(), {}, {}
    for tag, norm_map in NORM_MAPS.items():
        name = tag.replace("/", "_")
        policies[name] = {"normalization_mapping": norm_map}
        save_policy(m, out / name, norm_map, FIXTURE_DIMS["vision"]["image_size"])
        for case, missing in CASES.items():
            imgs = {c: v for c, v in images.items() if c not in missing}
            ref = lerobot_policy_stages(m, out / name, imgs, state, task, noise)
            for what in ("state", "tokens", "token_mask", "chunk", "actions"):
                expected[f"{name}.{case}.{what}"] = plain(ref[what])
            # The model's images depend on neither the stats nor the other cameras: kept once,
            # and each later run must give them again.
            for c, img in ref["images"].items():
                key = f"image.{c}"
                if key in expected:
                    if not np.array_equal(expected[key], plain(img)):
                        raise SystemExit(f"LeRobot's {c} image changed between runs")
                else:
                    expected[key] = plain(img)
            mine = our_policy_actions(out / name, dims, tokenizer, imgs, state, task, noise)
            report.add(f"[fixture {tag}] final actions, {case}", mine, ref["actions"], 1e-4)
    save_file(expected, str(out / "expected.safetensors"))
    meta = {
        "made_by": "tools/crosscheck_lerobot.py --write-fixture",
        "versions": versions(lerobot_version),
        "task": task, "cameras": {c: list(img.shape) for c, img in images.items()},
        "state_dim": STATE_DIM, "action_dim": ACTION_DIM_ROBOT, "chunk_size": CHUNK,
        "n_action_steps": N_ACTION_STEPS, "model_action_dim": ACTION_DIM,
        "policies": policies, "cases": {c: list(v) for c, v in CASES.items()},
        "expected": "expected.safetensors: <policy>.<case>.{state, tokens, token_mask, chunk, "
                    "actions} from LeRobot's preprocessor, predict_action_chunk(noise) and "
                    "postprocessor; image.<camera>: the model's input image (3xHxW in [-1, 1]) "
                    "from PI05Policy._preprocess_images",
    }
    (out / "fixture.json").write_text(json.dumps(meta, indent=1) + "\n")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    report.print()
    print(f"wrote {out}: {size} bytes in {sum(1 for f in out.rglob('*') if f.is_file())} files")
    if size > FIXTURE_LIMIT:
        print(f"FAILED: the fixture is over {FIXTURE_LIMIT} bytes")
        return 1
    return int(report.failed)


def main() -> int:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write-fixture", type=Path, metavar="DIR",
                        help="write the LeRobot fixture (test/fixtures/lerobot_pi05) to DIR "
                             "instead of running the cross-check")
    args = parser.parse_args()
    m, pg, version = import_lerobot()
    if args.write_fixture:
        return write_fixture(m, pg, args.write_fixture, version)
    import transformers

    from oxygen_ros.model import load_checkpoint
    from oxygen_ros.model.denoise import flow_times
    print(f"LeRobot {version}, transformers {transformers.__version__}, torch {torch.__version__}")
    torch.manual_seed(0)
    tiny_variants(m, pg)
    ref_model = build_lerobot(m)
    randomise(ref_model)
    inputs = make_inputs()
    times, dt = flow_times(STEPS)
    ref = lerobot_reference(m, ref_model, *inputs, times, dt)
    report = Report()
    cfg = our_config()
    with tempfile.TemporaryDirectory() as tmp:
        for layout, path in export(ref_model, Path(tmp)).items():
            model, _, info = load_checkpoint(path, cfg=cfg)
            if layout == "lerobot" and not info["prefixed"]:
                raise SystemExit("the LeRobot export was not recognised as prefixed")
            compare(report, layout, ours(model, *inputs), ref)
        # The check must be able to fail: each broken variant has to move the results.
        path = Path(tmp) / "openpi.safetensors"
        images, image_mask, tokens, token_mask, noise, decoded = inputs
        causal, _, _ = load_checkpoint(path, cfg=cfg.replace(prompt_attention="causal"))
        report.differs("causal prompt (OxyGen flavour) -> logits",
                       ours(causal, *inputs)["logits"], ref["logits"], 1e-2)
        report.differs("masked camera treated as valid -> logits",
                       ours(model, images, torch.ones_like(image_mask), tokens, token_mask,
                            noise, decoded)["logits"], ref["logits"], 1e-2)
        model.expert[0].norm1.weight.zero_()
        report.differs("expert layer 0 adaRMS weight zeroed -> v(t=1)",
                       ours(model, *inputs)["v1"], ref["v1"], 1e-2)
        check_policy_directory(m, report, Path(tmp))
    report.print()
    print("FAILED" if report.failed else "all within tolerance")
    return int(report.failed)


if __name__ == "__main__":
    sys.exit(main())
