"""Write test/fixtures/openpi_pi05/: openpi's own PyTorch pi0.5 on tiny random weights.

test/reference/test_openpi_fixture.py compares oxygen_ros's model with what is written here, in
every CI run and without openpi installed. Everything in the fixture comes from openpi's code at
one commit (src/openpi/models_pytorch/pi0_pytorch.py, gemma_pytorch.py,
preprocessing_pytorch.py, its transformers_replace, and PaligemmaTokenizer.tokenize from
src/openpi/models/tokenizer.py); nothing is imported from oxygen_ros.

What it holds (float32 throughout; fixture.safetensors unless said):
  model.safetensors  openpi's PI0Pytorch(pi05=True) state dict, written with
                     safetensors.torch.save_model as openpi's convert_jax_model_to_pytorch.py
                     and train_pytorch.py write it (the tied PaliGemma embedding appears once,
                     as lm_head), read back by safetensors.torch.load_model (strict) into a
                     fresh model, as openpi loads it, and checked equal;
  config.json        what openpi's converter writes beside it;
  model.yaml         the tiny dims as an oxygen_ros model config;
  tokenizer.model    a small SentencePiece model trained here (the PaliGemma one is not
                     reachable), given to openpi's tokenizer;
  inputs             3 rows, 3 cameras of 56x56 in [-1, 1] channels-first: all cameras / the
                     middle camera masked / only the first camera (masked cameras hold random
                     pixels, which must not matter); tasks and 6-d normalised states (values
                     outside [-1, 1] and on bin edges), tokenised by openpi's pi0.5 format
                     ("Task: ..., State: ...;\\nAction: ") to 64 tokens: two prompts padded to
                     different lengths, one truncated; the noise [3, 10, 32];
  outputs            from one call of openpi's sample_actions (10 steps): the prefix keys
                     (after RoPE) and values of every layer at the valid prefix columns, row
                     after row, the final-normed prefix hidden state and the PaliGemma lm_head
                     logits at each row's last valid prefix token, every denoise_step's input
                     x_t, time and velocity, and the final actions.
meta.json names the openpi commit, the torch / transformers / Python versions, the dims, the
tasks and what each tensor is.

openpi's code runs unmodified; only plumbing is replaced, as crosscheck_lerobot.py does for
LeRobot: openpi.models.gemma (a flax module, imported by pi0_pytorch.py only for
get_config's dims) is a stub whose get_config gives the tiny dims under the variant names
"tiny_vlm" / "tiny_expert"; PaliGemmaForConditionalGeneration and GemmaForCausalLM, as
gemma_pytorch.py calls them, get the tiny vision tower and vocabulary put into their configs
first (the expert's unused lm_head gets a 16-entry vocabulary, keeping the file small);
preprocess_observation_pytorch is called with image_resolution=(56, 56), so the images pass
through unchanged (openpi's resize_with_pad_torch is never reached: openpi.shared.image_tools,
a jax module, is an empty stub); openpi.models.tokenizer is imported with jax, orbax,
fsq_tokenizer and download stubbed (only its __init__, which downloads the PaliGemma
model, needs them). PI0Pytorch sets torch.set_float32_matmul_precision("high") for GPUs; it
is set back to "highest" so that CPU matmuls stay plain fp32 (on this project's CPU the
outputs were bit-identical either way).

Run it from an openpi tree in its own environment, never the project's venv:
    python3 -m venv /tmp/openpi-venv
    /tmp/openpi-venv/bin/pip install torch==2.13.0   # the CPU build on this machine
    /tmp/openpi-venv/bin/pip install transformers==4.53.2 safetensors sentencepiece \
        'numpy<2' pyyaml
    # fetch github:Physical-Intelligence/openpi, then (GIT is its git directory):
    mkdir -p /tmp/openpi-src && git --git-dir=$GIT archive HEAD | tar -x -C /tmp/openpi-src
    cp -r /tmp/openpi-src/src/openpi/models_pytorch/transformers_replace/* \
        /tmp/openpi-venv/lib/python3.11/site-packages/transformers/
    OMP_NUM_THREADS=1 /tmp/openpi-venv/bin/python tools/openpi_fixture.py \
        --openpi /tmp/openpi-src --commit $(git --git-dir=$GIT rev-parse HEAD)
(checked with openpi 15a9616a00943ada6c20a0f158e3adb39df2ccac, transformers 4.53.2 with
openpi's replacements, torch 2.13.0+cpu, Python 3.11.7: 7-17 s wall on a busy 2-core
machine, 380 MB peak memory; two runs wrote byte-identical files. The tool refuses to run
when the installed transformers files differ from the tree's transformers_replace.)

Not covered: bf16 (openpi keeps the vision embeddings and every norm in fp32 there, as we do,
but this fixture is fp32 only), real pi0.5 dims or weights (heads=8 is required: openpi's
joint attention reshapes to 8 heads), openpi's image resizing and its training
augmentations, the normalisation of states and actions, text decoding after the prefix
(openpi's pi0.5 has none), the "causal" prompt flavour (openpi has only the bidirectional
prefix), and the real PaliGemma tokenizer model.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import io
import json
import platform
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

torch.set_num_threads(1)

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "test" / "fixtures" / "openpi_pi05"

VOCAB = 1024
EXPERT_VOCAB = 16  # the expert's lm_head, present in openpi's files, unused by pi0.5
# heads=8 is fixed by openpi's joint attention; kv_heads=2 makes the grouping order matter.
VLM = dict(width=64, depth=3, mlp=128, heads=8, kv_heads=2, head_dim=8)
EXPERT = dict(width=32, depth=3, mlp=64, heads=8, kv_heads=2, head_dim=8)
VISION = dict(width=32, depth=2, mlp=64, heads=2, patch=14, image_size=56)
SLOTS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
ACTION_DIM, HORIZON, MAX_TOKENS, STEPS, STATE_DIM = 32, 10, 64, 10, 6
VARIANTS = {"tiny_vlm": VLM, "tiny_expert": EXPERT}
TASKS = ("pick up the red cube",
         "  Put the_blue block\ninto the bowl ",
         "wipe the table with the towel, then fold the towel and stack the towel on the box "
         "next to the green cup")
IMAGE_MASK = ((True, True, True), (True, False, True), (True, False, False))


# --------------------------------------------------------------------------- openpi import


class _Stub(types.ModuleType):
    """A module standing in for one openpi's PyTorch path only names."""

    def __getattr__(self, name):
        raise AttributeError(f"{self.__name__} is a stub here: it has no {name}")


def _gemma_stub():
    m = _Stub("openpi.models.gemma")

    def get_config(variant):
        v = VARIANTS[variant]
        return SimpleNamespace(width=v["width"], depth=v["depth"], mlp_dim=v["mlp"],
                               num_heads=v["heads"], num_kv_heads=v["kv_heads"],
                               head_dim=v["head_dim"], lora_configs={})

    m.get_config = get_config
    m.PALIGEMMA_VOCAB_SIZE = 257_152
    return m


def check_transformers(src: Path) -> str:
    """The installed transformers must carry this tree's transformers_replace files."""
    import transformers
    root = Path(transformers.__file__).parent
    repl = src / "src/openpi/models_pytorch/transformers_replace"
    stale = [str(p.relative_to(repl)) for p in sorted(repl.rglob("*.py"))
             if not (root / p.relative_to(repl)).is_file()
             or (root / p.relative_to(repl)).read_bytes() != p.read_bytes()]
    if stale:
        sys.exit(f"transformers at {root} lacks openpi's replacements {stale}; copy "
                 f"{repl}/* over it (see the module docstring)")
    return transformers.__version__


def import_openpi(src: Path):
    """openpi's pi0_pytorch, gemma_pytorch and preprocessing modules, and its tokenizer
    class, from the tree at ``src``."""
    sys.path.insert(0, str(src / "src"))
    import openpi.models
    import openpi.shared
    import transformers  # noqa: F401  (before any stub: it probes for jax)
    openpi.models.gemma = sys.modules["openpi.models.gemma"] = _gemma_stub()
    openpi.shared.image_tools = sys.modules["openpi.shared.image_tools"] = _Stub(
        "openpi.shared.image_tools")
    from openpi.models_pytorch import gemma_pytorch, pi0_pytorch, preprocessing_pytorch
    # openpi.models.tokenizer imports these for what PaligemmaTokenizer.tokenize never uses.
    names = ("jax", "orbax", "orbax.checkpoint", "openpi.models.utils",
             "openpi.models.utils.fsq_tokenizer", "openpi.shared.download")
    saved = {n: sys.modules.get(n) for n in names}
    for n in names:
        sys.modules[n] = _Stub(n)
    try:
        from openpi.models import tokenizer
    finally:
        for n, mod in saved.items():
            if mod is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = mod
    return pi0_pytorch, gemma_pytorch, preprocessing_pytorch, tokenizer


def tiny_configs(gp):
    """Put the tiny vision tower and vocabularies into the configs gemma_pytorch builds."""
    pali_cls, gemma_cls = gp.PaliGemmaForConditionalGeneration, gp.GemmaForCausalLM

    def paligemma(config):
        config.text_config.vocab_size = VOCAB
        vc = config.vision_config
        vc.hidden_size, vc.num_hidden_layers = VISION["width"], VISION["depth"]
        vc.intermediate_size, vc.num_attention_heads = VISION["mlp"], VISION["heads"]
        vc.patch_size, vc.image_size = VISION["patch"], VISION["image_size"]
        vc.projection_dim = config.projection_dim = VLM["width"]
        return pali_cls(config=config)

    def expert(config):
        config.vocab_size = EXPERT_VOCAB
        return gemma_cls(config=config)

    gp.PaliGemmaForConditionalGeneration = paligemma
    gp.GemmaForCausalLM = expert


def build(pp):
    cfg = SimpleNamespace(pi05=True, paligemma_variant="tiny_vlm",
                          action_expert_variant="tiny_expert", dtype="float32",
                          action_dim=ACTION_DIM, action_horizon=HORIZON,
                          pytorch_compile_mode=None)
    model = pp.PI0Pytorch(cfg).eval()
    torch.set_float32_matmul_precision("highest")
    return model


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int = 0):
    """Seeded values of O(1) effect for every parameter, so that what openpi initialises to
    zero (adaRMS dense layers, RMSNorm offsets, biases) takes part in the comparison."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():  # a tied parameter is listed once
        noise = torch.randn(p.shape, generator=g)
        if "embed_tokens" in name or "lm_head" in name:
            p.copy_(noise / p.shape[-1] ** 0.5)
        elif "position_embedding" in name:
            p.copy_(0.5 * noise)
        elif p.ndim >= 2:
            p.copy_(noise / p[0].numel() ** 0.5)
        elif "layer_norm" in name or "post_layernorm" in name:
            p.copy_((1.0 + 0.2 * noise) if name.endswith("weight") else 0.2 * noise)
        else:  # Gemma norm offsets (scale 1 + w) and biases
            p.copy_(0.2 * noise)


# --------------------------------------------------------------------------- inputs


def train_tokenizer() -> bytes:
    """A small BPE model with PaliGemma's special ids, digits one per piece and "\\n" a
    piece of its own."""
    import sentencepiece as spm
    objects = ("red cube", "blue block", "green cup", "bowl", "towel", "box", "plate")
    verbs = ("pick up the {}", "put the {} into the bowl", "wipe the table with the {}",
             "fold the {}", "stack the {} on the box")
    lines = [f"Task: {v.format(o)}, State: {i * 37 % 256} {i * 91 % 256};\nAction: "
             for i, (v, o) in enumerate((v, o) for v in verbs for o in objects)]
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=out, model_type="bpe", vocab_size=700,
        hard_vocab_limit=False, byte_fallback=True, character_coverage=1.0,
        split_digits=True, user_defined_symbols=["\n"], normalization_rule_name="identity",
        remove_extra_whitespaces=False, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        num_threads=1, shuffle_input_sentence=False, minloglevel=2)
    return out.getvalue()


def make_inputs(tok_module, spm_bytes: bytes, seed: int = 1) -> dict[str, torch.Tensor]:
    import sentencepiece as spm
    g = torch.Generator().manual_seed(seed)
    b, size = len(TASKS), VISION["image_size"]
    images = torch.rand(b, len(SLOTS), 3, size, size, generator=g) * 2 - 1
    states = torch.rand(b, STATE_DIM, generator=g) * 2.4 - 1.2
    states[0, 0], states[0, 1], states[1, 2] = -1.0, 1.0, -1.0 + 2.0 / 256  # on bin edges
    # openpi's tokenizer with this model in place of the PaliGemma download.
    tokenizer = tok_module.PaligemmaTokenizer.__new__(tok_module.PaligemmaTokenizer)
    tokenizer._max_len = MAX_TOKENS
    tokenizer._tokenizer = spm.SentencePieceProcessor(model_proto=spm_bytes)
    tokens, masks = zip(*(tokenizer.tokenize(t, s.numpy()) for t, s in zip(TASKS, states,
                                                                           strict=True)),
                        strict=True)
    tokens = torch.from_numpy(np.stack(tokens).astype(np.int64))
    token_mask = torch.from_numpy(np.stack(masks).astype(bool))
    lengths = token_mask.sum(1).tolist()
    if len(set(lengths)) != b or lengths[-1] != MAX_TOKENS or max(lengths[:-1]) >= MAX_TOKENS:
        raise SystemExit(f"prompt lengths {lengths}: want distinct, the last truncated")
    noise = torch.randn(b, HORIZON, ACTION_DIM, generator=g)
    return {"images": images, "image_mask": torch.tensor(IMAGE_MASK), "state": states,
            "tokens": tokens, "token_mask": token_mask, "noise": noise}


# --------------------------------------------------------------------------- openpi run


@torch.no_grad()
def run_openpi(pp, prep, model, inp) -> dict[str, torch.Tensor]:
    """One sample_actions call, with its prefix, cache and every denoise step recorded."""
    rec: dict = {"steps": []}
    embed_prefix, forward, denoise_step = (model.embed_prefix,
                                           model.paligemma_with_expert.forward,
                                           model.denoise_step)

    def embed_prefix_rec(*a, **k):
        out = embed_prefix(*a, **k)
        rec["pad"] = out[1].clone()
        return out

    def forward_rec(*a, **k):
        out = forward(*a, **k)
        if k["inputs_embeds"][1] is None:  # the prefix pass, which fills the cache
            rec["hidden"] = out[0][0].clone()
            rec["cache"] = [(out[1][i][0].clone(), out[1][i][1].clone())
                            for i in range(len(out[1]))]
        return out

    def denoise_rec(state, pad, cache, x_t, timestep):
        v = denoise_step(state, pad, cache, x_t, timestep)
        rec["steps"].append((x_t.clone(), timestep.clone(), v.clone()))
        return v

    model.embed_prefix, model.denoise_step = embed_prefix_rec, denoise_rec
    model.paligemma_with_expert.forward = forward_rec
    # Images already at the tower's size pass openpi's preprocessing unchanged.
    pp._preprocessing = SimpleNamespace(preprocess_observation_pytorch=functools.partial(
        prep.preprocess_observation_pytorch, image_resolution=(VISION["image_size"],) * 2))
    obs = SimpleNamespace(
        images={s: inp["images"][:, i] for i, s in enumerate(SLOTS)},
        image_masks={s: inp["image_mask"][:, i] for i, s in enumerate(SLOTS)},
        state=inp["state"], tokenized_prompt=inp["tokens"],
        tokenized_prompt_mask=inp["token_mask"], token_ar_mask=None, token_loss_mask=None)
    actions = model.sample_actions("cpu", obs, noise=inp["noise"].clone(), num_steps=STEPS)

    pad = rec["pad"]
    b = pad.shape[0]
    last = (pad * torch.arange(1, pad.shape[1] + 1)).argmax(1)
    hidden = rec["hidden"][torch.arange(b), last]
    out = {"prefix_pad": pad, "hidden": hidden,
           "logits": model.paligemma_with_expert.paligemma.lm_head(hidden),
           "actions": actions}
    for i, (k, v) in enumerate(rec["cache"]):
        # [B, kv_heads, L, head_dim] -> [kv_heads, valid columns of row 0, row 1, ..., d]
        out[f"prefix_keys.{i}"] = torch.cat([k[r][:, pad[r]] for r in range(b)], 1)
        out[f"prefix_values.{i}"] = torch.cat([v[r][:, pad[r]] for r in range(b)], 1)
    out["step_x"] = torch.stack([s[0] for s in rec["steps"]])
    out["step_time"] = torch.stack([s[1] for s in rec["steps"]])
    out["step_velocity"] = torch.stack([s[2] for s in rec["steps"]])
    return out


def reload_check(pp, path: Path, model) -> None:
    """openpi's loading of the file (safetensors.torch.load_model, strict) restores it."""
    from safetensors.torch import load_model
    again = build(pp)
    load_model(again, str(path), strict=True)
    ref, got = model.state_dict(), again.state_dict()
    bad = [k for k in ref if not torch.equal(ref[k], got[k])]
    if bad:
        raise SystemExit(f"openpi's reload of {path} differs at {bad[:5]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--openpi", type=Path, required=True, help="an openpi source tree")
    ap.add_argument("--commit", required=True, help="the openpi commit of that tree")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    tf_version = check_transformers(args.openpi)
    pp, gp, prep, tok = import_openpi(args.openpi)
    tiny_configs(gp)
    torch.manual_seed(0)
    model = build(pp)
    randomise(model)
    pali = model.paligemma_with_expert.paligemma
    if pali.lm_head.weight is not pali.model.language_model.embed_tokens.weight:
        raise SystemExit("PaliGemma's lm_head is not tied to its embedding")
    spm_bytes = train_tokenizer()
    inp = make_inputs(tok, spm_bytes)
    out = run_openpi(pp, prep, model, inp)

    from safetensors.torch import save_file, save_model
    args.out.mkdir(parents=True, exist_ok=True)
    weights = args.out / "model.safetensors"
    save_model(model, str(weights))
    reload_check(pp, weights, model)
    (args.out / "config.json").write_text(json.dumps(
        {"action_dim": ACTION_DIM, "action_horizon": HORIZON, "paligemma_variant": "tiny_vlm",
         "action_expert_variant": "tiny_expert", "precision": "float32"}, indent=2) + "\n")
    (args.out / "tokenizer.model").write_bytes(spm_bytes)
    import yaml
    dims = dict(name="openpi_fixture", vlm=VLM, expert=EXPERT, vision=VISION, vocab=VOCAB,
                action_dim=ACTION_DIM, action_horizon=HORIZON, max_token_len=MAX_TOKENS,
                image_slots=list(SLOTS), prompt_attention="bidirectional", rope_base=10000.0,
                time_grid="openpi")
    (args.out / "model.yaml").write_text(
        "# Dims of the openpi fixture (tools/openpi_fixture.py); heads=8 as openpi requires.\n"
        + yaml.safe_dump(dims, sort_keys=False))
    tensors = {**inp, **out}
    tensors = {k: (v.float() if v.is_floating_point() else v).contiguous()
               for k, v in tensors.items()}
    save_file(tensors, str(args.out / "fixture.safetensors"))
    meta = {
        "openpi_commit": args.commit, "transformers": tf_version, "torch": torch.__version__,
        "python": platform.python_version(), "numpy": np.__version__,
        "tool": "tools/openpi_fixture.py", "tasks": list(TASKS), "steps": STEPS,
        "slots": list(SLOTS), "tokenizer_sha256": hashlib.sha256(spm_bytes).hexdigest(),
        "tensors": {
            "images": "[B, cameras, 3, H, W] in [-1, 1]; masked cameras hold random pixels",
            "image_mask": "[B, cameras] bool", "state": "[B, 6] normalised, in the prompt",
            "tokens": "[B, max_token_len] PaligemmaTokenizer.tokenize(task, state)",
            "token_mask": "[B, max_token_len] bool", "noise": "[B, horizon, action_dim]",
            "prefix_pad": "[B, cameras * image_tokens + max_token_len] valid prefix columns",
            "prefix_keys.<layer>": "[kv_heads, valid columns of all rows, head_dim], RoPE'd",
            "prefix_values.<layer>": "[kv_heads, valid columns of all rows, head_dim]",
            "hidden": "[B, width] final-normed, at the last valid prefix token",
            "logits": "[B, vocab] PaliGemma lm_head of hidden",
            "step_x": "[steps, B, horizon, action_dim] x_t given to denoise_step",
            "step_time": "[steps, B] its timestep", "step_velocity": "its output v_t",
            "actions": "[B, horizon, action_dim] sample_actions(noise, num_steps=steps)"}}
    (args.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    total = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"openpi {args.commit}, transformers {tf_version}, torch {torch.__version__}")
    print(f"prompt lengths {inp['token_mask'].sum(1).tolist()}, "
          f"max|actions| {out['actions'].abs().max():.3f}, "
          f"max|logits| {out['logits'].abs().max():.3f}")
    print(f"wrote {args.out}: {total} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
