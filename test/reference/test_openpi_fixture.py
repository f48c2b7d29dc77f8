"""The model against openpi's own PyTorch pi0.5, recorded in test/fixtures/openpi_pi05/.

tools/openpi_fixture.py ran openpi's code (commit and versions in meta.json) on tiny random
weights and wrote its weights, inputs and outputs; nothing here imports openpi. The weights
are read with checkpoint.py and the dims with config.py, as for any openpi checkpoint.

Tolerance: every output is compared at 1e-5, absolute where the reference's largest
magnitude is at most 1 and relative to that magnitude above it (|ours - openpi| <=
1e-5 * max(1, max|openpi|) over the whole tensor).
"""

import json

import pytest
import torch
from safetensors.torch import load_file
from support.paths import FIXTURES  # noqa: E402

from oxygen_ros.model import KV, load_checkpoint, load_config
from oxygen_ros.model.checkpoint import EXP, open_checkpoint
from oxygen_ros.model.denoise import flow_times
from oxygen_ros.model.tokenizer import Tokenizer, action_prompt

torch.set_num_threads(2)

FIXTURE = FIXTURES / "openpi_pi05"
TOL = 1e-5


def excess(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| over the allowed difference; <= 1 passes."""
    assert ours.shape == ref.shape, (tuple(ours.shape), tuple(ref.shape))
    diff = (ours.double() - ref.double()).abs().max().item()
    return diff / (TOL * max(1.0, ref.abs().max().item()))


def assert_close(ours, ref, what):
    ratio = excess(ours, ref)
    assert ratio <= 1.0, f"{what}: difference {ratio:.2f} times the tolerance"


@pytest.fixture(scope="module")
def fx():
    return load_file(str(FIXTURE / "fixture.safetensors"))


@pytest.fixture(scope="module")
def meta():
    return json.loads((FIXTURE / "meta.json").read_text())


@pytest.fixture(scope="module")
def cfg():
    return load_config(FIXTURE / "model.yaml")


@pytest.fixture(scope="module")
def loaded(cfg):
    return load_checkpoint(FIXTURE, cfg=cfg)


@torch.no_grad()
def run(model, fx, image_mask=None):
    """Our prefill, logits and 10-step denoise on the fixture's inputs."""
    cfg = model.cfg
    image_mask = fx["image_mask"] if image_mask is None else image_mask
    rows = image_mask.shape[0]
    kv = KV.allocate(cfg, rows=rows, max_len=cfg.prefix_len)
    hidden = model.prefill(fx["images"], image_mask, fx["tokens"], fx["token_mask"], kv,
                           slice(None))
    # The valid prefix columns of each row, in order, concatenated row after row.
    valid = [kv.valid[r, :kv.length[r]] for r in range(rows)]
    keys = [torch.cat([kv.k[i][r, :, :len(c)][:, c] for r, c in enumerate(valid)], 1)
            for i in range(kv.depth)]
    values = [torch.cat([kv.v[i][r, :, :len(c)][:, c] for r, c in enumerate(valid)], 1)
              for i in range(kv.depth)]
    trace: list = []
    actions = model.denoise(kv, slice(None), fx["noise"], steps=len(fx["step_time"]),
                            trace=trace)
    return {"hidden": hidden, "logits": model.logits(hidden), "keys": keys, "values": values,
            "velocities": torch.stack(trace), "actions": actions}


@pytest.fixture(scope="module")
def ours(loaded, fx):
    return run(loaded[0], fx)


def test_fixture_is_small_float32_and_says_where_it_came_from(fx, meta):
    total = sum(p.stat().st_size for p in FIXTURE.iterdir())
    assert total < 2 * 2**20
    assert len(meta["openpi_commit"]) == 40 and int(meta["openpi_commit"], 16) >= 0
    assert meta["transformers"].startswith("4.53.") and meta["torch"]
    weights = load_file(str(FIXTURE / "model.safetensors"))
    for name, t in {**weights, **fx}.items():
        if t.is_floating_point():
            assert t.dtype == torch.float32, name
    # Cameras: all, the middle one masked, only the first; prompts of distinct lengths, the
    # last one truncated to max_token_len.
    assert fx["image_mask"].tolist() == [[True] * 3, [True, False, True], [True, False, False]]
    assert fx["images"][1, 1].abs().mean() > 0.1  # a masked camera's pixels are not blank
    lengths = fx["token_mask"].sum(1).tolist()
    assert len(set(lengths)) == 3 and lengths[-1] == fx["tokens"].shape[1]


def test_openpi_file_loads_strictly_with_its_tied_head(loaded, cfg):
    model, stats, info = loaded
    assert info["tied"] and stats is None  # openpi writes the tied matrix once, as lm_head
    assert info["ignored"] == [EXP + "lm_head.weight"]  # the expert's unused head
    ckpt = open_checkpoint(FIXTURE, dims=cfg, normalize=False)
    assert (ckpt.layout, ckpt.conventions) == ("openpi", "openpi")
    assert (ckpt.action_dim, ckpt.horizon) == (32, 10)
    a, b = dict(model.named_parameters()), dict(ckpt.model.named_parameters())
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_prompt_tokens_match_openpis_tokenizer(fx, meta):
    # openpi's PaligemmaTokenizer.tokenize(task, state) with the fixture's SentencePiece model.
    tok = Tokenizer(FIXTURE / "tokenizer.model")
    n = fx["tokens"].shape[1]
    for row, task in enumerate(meta["tasks"]):
        tokens, mask = tok.tokenize(action_prompt(task, fx["state"][row].numpy()), n)
        assert tokens.tolist() == fx["tokens"][row].tolist(), row
        assert mask.tolist() == fx["token_mask"][row].tolist(), row


def test_flow_times_are_openpis(fx):
    times, dt = flow_times(len(fx["step_time"]), "openpi")
    ref = fx["step_time"]
    assert torch.equal(ref, ref[:, :1].expand_as(ref))  # one time for all rows
    assert times == ref[:, 0].tolist()  # bit for bit
    assert dt == pytest.approx(-0.1, abs=1e-7)


def test_prefix_keys_and_values_match_openpi(ours, fx):
    assert len(ours["keys"]) == 3
    for i, (k, v) in enumerate(zip(ours["keys"], ours["values"], strict=True)):
        assert_close(k, fx[f"prefix_keys.{i}"], f"layer {i} keys (after RoPE)")
        assert_close(v, fx[f"prefix_values.{i}"], f"layer {i} values")


def test_last_prefix_hidden_and_text_logits_match_openpi(ours, loaded, fx):
    assert_close(ours["hidden"], fx["hidden"], "final-normed hidden at last valid token")
    assert_close(ours["logits"], fx["logits"], "lm_head logits at last valid token")
    # The uncached reference path gives the same logits.
    model = loaded[0]
    full = model.forward_text(fx["images"], fx["image_mask"], fx["tokens"], fx["token_mask"],
                              torch.zeros(3, 0, dtype=torch.long))
    assert_close(full[:, 0], fx["logits"], "forward_text logits at last valid token")


def test_denoise_velocities_and_actions_match_openpi(ours, fx):
    for step in range(len(fx["step_time"])):
        assert_close(ours["velocities"][step], fx["step_velocity"][step],
                     f"velocity of step {step} (t={fx['step_time'][step, 0].item():.7f})")
    assert_close(ours["actions"], fx["actions"], "sample_actions result")


def test_uncached_velocity_at_openpis_inputs(loaded, fx):
    # forward_full runs [prefix | chunk] jointly; fed openpi's own x_t of every step, it
    # checks a velocity without our trajectory in between (three steps: it is slow).
    model = loaded[0]
    for step in (0, 4, len(fx["step_time"]) - 1):
        v = model.forward_full(fx["images"], fx["image_mask"], fx["tokens"], fx["token_mask"],
                               fx["step_x"][step], fx["step_time"][step, 0].item())
        assert_close(v, fx["step_velocity"][step], f"forward_full velocity, step {step}")


# The comparison can fail: each of these changes moves some output well past the tolerance.


def test_causal_prompt_is_detected(cfg, fx):
    model, _, _ = load_checkpoint(FIXTURE, cfg=cfg.replace(prompt_attention="causal"))
    out = run(model, fx)
    assert excess(out["logits"], fx["logits"]) > 100
    assert excess(out["keys"][1], fx["prefix_keys.1"]) > 100
    assert excess(out["actions"], fx["actions"]) > 100


def test_masked_camera_treated_as_valid_is_detected(loaded, fx):
    out = run(loaded[0], fx, image_mask=torch.ones_like(fx["image_mask"]))
    assert excess(out["logits"], fx["logits"]) > 100
    assert excess(out["actions"], fx["actions"]) > 100


@pytest.mark.parametrize("name", ["vlm.2.o.weight", "expert.1.norm2.weight", "time_in.weight",
                                  "vision.layers.0.fc1.weight"])
def test_one_perturbed_weight_is_detected(cfg, fx, name):
    # One entry moved by 0.05; the last VLM layer's output projection reaches only the
    # logits (the expert reads keys and values), the expert's weights only the actions.
    model, _, _ = load_checkpoint(FIXTURE, cfg=cfg)
    with torch.no_grad():
        dict(model.named_parameters())[name].view(-1)[3] += 0.05
    out = run(model, fx)
    assert max(excess(out["logits"], fx["logits"]), excess(out["actions"], fx["actions"])) > 10
