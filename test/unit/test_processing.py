import json

import numpy as np
import pytest
import torch

from oxygen_ros.model.processing import (
    NormStats,
    Stats,
    crop,
    find_norm_stats,
    prepare_image,
    resize_with_pad,
    resize_with_pad_float,
    to_model_image,
)


def test_resize_wide_constant_image_pads_top_and_bottom():
    img = np.full((2, 4, 3), 100, dtype=np.uint8)
    out = resize_with_pad(img, 8, 8)
    # scale 2 -> 4x8, (8 - 4) / 2 = 2 black rows above and below
    assert out.shape == (8, 8, 3) and out.dtype == np.uint8
    assert (out[2:6] == 100).all()
    assert (out[:2] == 0).all() and (out[6:] == 0).all()


def test_resize_tall_image_pads_left_and_right():
    img = np.full((8, 2, 3), 50, dtype=np.uint8)
    out = resize_with_pad(img, 4, 4)
    # ratio max(2/4, 8/4) = 2 -> 4x1, left pad (4 - 1) // 2 = 1
    assert (out[:, 1] == 50).all()
    assert (out[:, [0, 2, 3]] == 0).all()


def test_resize_odd_padding_goes_bottom():
    img = np.full((3, 8, 3), 9, dtype=np.uint8)
    out = resize_with_pad(img, 8, 8)
    # same width, 5 rows of padding: 2 on top, 3 below
    assert (out[2:5] == 9).all()
    assert (out[:2] == 0).all() and (out[5:] == 0).all()


def test_resize_camera_frame():
    img = np.full((480, 640, 3), 7, dtype=np.uint8)
    out = resize_with_pad(img)
    # 640x480 -> 224x168, 28 rows of black above and below
    assert out.shape == (224, 224, 3)
    assert (out[28:196] == 7).all()
    assert (out[:28] == 0).all() and (out[196:] == 0).all()


def test_resize_same_size_is_unchanged():
    img = np.random.default_rng(0).integers(0, 256, (6, 6, 3), dtype=np.uint8)
    out = resize_with_pad(img, 6, 6)
    assert np.array_equal(out, img) and out is not img


def test_resize_keeps_horizontal_order():
    img = np.zeros((2, 4, 3), dtype=np.uint8)
    img[:, 2:] = 200
    out = resize_with_pad(img, 2, 2)
    assert out[0, 0, 0] < out[0, 1, 0]


def test_resize_close_to_pil():
    pil = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(1)
    for h, w in [(48, 64), (37, 51), (10, 6)]:
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        ratio = max(w / 32, h / 32)
        nh, nw = int(h / ratio), int(w / ratio)
        ref = np.asarray(pil.fromarray(img).resize((nw, nh), resample=pil.BILINEAR))
        top, left = (32 - nh) // 2, (32 - nw) // 2
        out = resize_with_pad(img, 32, 32)
        diff = out[top : top + nh, left : left + nw].astype(int) - ref.astype(int)
        assert np.abs(diff).max() <= 1


def test_resize_rejects_float():
    with pytest.raises(ValueError):
        resize_with_pad(np.zeros((4, 4, 3), dtype=np.float32))


def test_to_model_image_values_and_layout():
    img = np.zeros((1, 2, 3), dtype=np.uint8)
    img[0, 0] = [0, 255, 51]
    img[0, 1] = [255, 0, 102]
    x = to_model_image(img)
    assert x.dtype == torch.float32 and x.shape == (3, 1, 2)
    expected = torch.tensor([[[-1.0, 1.0]], [[1.0, -1.0]], [[-0.6, -0.2]]])
    assert torch.allclose(x, expected, atol=1e-6)


def test_prepare_image_shape():
    x = prepare_image(np.full((480, 640, 3), 255, dtype=np.uint8))
    assert x.shape == (3, 224, 224)
    assert x[:, 0, 0].tolist() == [-1.0, -1.0, -1.0]  # padding is black
    assert x[:, 112, 112].tolist() == [1.0, 1.0, 1.0]


def test_to_model_image_rejects_gray():
    with pytest.raises(ValueError):
        to_model_image(np.zeros((4, 4, 1), dtype=np.uint8))


STATS = {
    "norm_stats": {
        "state": {"mean": [1.0, 2.0], "std": [2.0, 4.0], "q01": [0.0, -1.0], "q99": [2.0, 1.0]},
        "actions": {
            "mean": [0.0, 0.0, 0.0],
            "std": [1.0, 1.0, 1.0],
            "q01": [-2.0, 0.0, 10.0],
            "q99": [2.0, 1.0, 20.0],
        },
    }
}


def test_quantile_normalize_by_hand():
    ns = NormStats.from_dict(STATS)
    x = ns.normalize_state([1.0, 0.0])
    assert x[0] == pytest.approx((1 - 0) / (2 - 0 + 1e-6) * 2 - 1)
    assert x[1] == pytest.approx((0 + 1) / (1 + 1 + 1e-6) * 2 - 1)
    assert ns.normalize_state([0.0, -1.0]).tolist() == [-1.0, -1.0]  # q01 maps to -1


def test_quantile_unnormalize_by_hand():
    ns = NormStats.from_dict(STATS)
    a = ns.unnormalize_actions(np.array([[-1.0, 1.0, 0.0]]))
    assert a[0].tolist() == pytest.approx([-2.0, 1.0 + 1e-6, 15.0 + 5e-7])
    # openpi keeps the 1e-6 of the denominator when undoing it: q99 maps to q99 + 1e-6.
    assert a[0, 1] - 1.0 == pytest.approx(1e-6, rel=1e-4)
    assert a[0, 2] - 15.0 == pytest.approx(5e-7, rel=1e-4)


def test_mean_std_variant_by_hand():
    ns = NormStats.from_dict(STATS, quantile=False)
    x = ns.normalize_state([3.0, 2.0])
    assert x.tolist() == pytest.approx([2 / (2 + 1e-6), 0.0])
    assert ns.unnormalize_state(x).tolist() == pytest.approx([3.0, 2.0])


def test_padding_dims_pass_through():
    ns = NormStats.from_dict(STATS)
    x = ns.normalize_state([0.0, -1.0, 5.0, 0.0])
    assert x.tolist() == [-1.0, -1.0, 5.0, 0.0]
    a = ns.unnormalize_actions(np.zeros((2, 32)))
    assert np.allclose(a[:, :3], [[0.0, 0.5, 15.0]] * 2, atol=1e-5)
    assert (a[:, 3:] == 0).all()
    # a robot with fewer dims than the stats uses the first ones
    assert ns.normalize_state([2.0]).tolist() == pytest.approx([1.0], abs=1e-5)


def test_round_trip():
    ns = NormStats.from_dict(STATS)
    a = np.random.default_rng(0).uniform(-1, 1, (5, 32))
    assert np.allclose(ns.normalize_actions(ns.unnormalize_actions(a)), a)


def test_from_json_and_errors(tmp_path):
    path = tmp_path / "norm_stats.json"
    path.write_text(json.dumps(STATS))
    assert NormStats.from_json(path).state.values["q99"].tolist() == [2.0, 1.0]
    assert NormStats.from_dict(STATS["norm_stats"]).actions.dim == 3
    no_q = {"state": {"mean": [0], "std": [1]}, "actions": {"mean": [0], "std": [1]}}
    with pytest.raises(ValueError, match="q01"):
        NormStats.from_dict(no_q)
    assert NormStats.from_dict(no_q, quantile=False).normalize_state([2.0])[0] == (
        pytest.approx(2.0 / (1 + 1e-6))
    )
    with pytest.raises(ValueError, match="actions"):
        NormStats.from_dict({"state": STATS["norm_stats"]["state"]})


def _put(root, asset):
    p = root / "assets" / asset / "norm_stats.json"
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps(STATS))
    return p


def test_find_norm_stats(tmp_path):
    with pytest.raises(FileNotFoundError):
        find_norm_stats(tmp_path)
    trossen = _put(tmp_path, "trossen")
    assert find_norm_stats(tmp_path) == trossen
    droid = _put(tmp_path, "droid")
    with pytest.raises(ValueError, match="droid"):
        find_norm_stats(tmp_path)
    assert find_norm_stats(tmp_path, "droid") == droid
    with pytest.raises(FileNotFoundError):
        find_norm_stats(tmp_path, "libero")


# --------------------------------------------------------------------------- LeRobot's ways


def test_lerobot_resize_upsamples_bilinearly_and_pads_with_zero():
    row = np.array([[[0, 0, 0], [255, 255, 255]]], dtype=np.uint8)  # 1 x 2
    out = resize_with_pad_float(row, 4, 4)  # scale 2 -> 2 x 4, one zero row above and below
    assert out.shape == (3, 4, 4) and out.dtype == torch.float32
    # align_corners=False: output x samples input (x + 0.5) / 2 - 0.5, clamped to the edges
    expected = torch.tensor([0.0, 0.25, 0.75, 1.0])
    for c in range(3):
        assert torch.equal(out[c, 1], expected) and torch.equal(out[c, 2], expected)
        assert torch.equal(out[c, 0], torch.zeros(4)) and torch.equal(out[c, 3], torch.zeros(4))


def test_lerobot_resize_shrinks_without_antialias():
    img = np.zeros((2, 4, 3), dtype=np.uint8)
    img[:, :, 0] = [[0, 40, 80, 200]] * 2
    out = resize_with_pad_float(img, 2, 2)  # scale 1/2 -> 1 x 2, padded to 2 x 2 (bottom)
    # plain bilinear at half size averages neighbour pairs; antialias would spread wider
    assert out[0, 0].tolist() == pytest.approx([20 / 255, 140 / 255], abs=1e-7)
    assert out[0, 1].tolist() == [0.0, 0.0]
    openpi = prepare_image(img, 2, 2)[0, 0]
    lerobot = prepare_image(img, 2, 2, "lerobot")[0, 0]
    assert lerobot.tolist() == pytest.approx([20 / 255 * 2 - 1, 140 / 255 * 2 - 1], abs=1e-6)
    assert not torch.allclose(openpi, lerobot, atol=1e-2)
    with pytest.raises(ValueError, match="conventions"):
        prepare_image(img, 2, 2, "jax")


STATE = {"mean": [1.0, -2.0], "std": [2.0, 0.5], "q01": [-1.0, 0.0], "q99": [3.0, 0.0],
         "q10": [0.0, -1.0], "q90": [2.0, 1.0], "min": [-3.0, 5.0], "max": [5.0, 5.0]}


def lerobot(mode):
    return NormStats(Stats.from_dict(STATE, mode), Stats.from_dict(STATE, mode), "lerobot",
                     eps=1e-8)


def test_lerobot_modes_by_hand():
    x = np.array([2.0, 0.25], np.float32)
    eps = np.float32(1e-8)
    cases = {
        # LeRobot's eps only replaces a zero span (q99 == q01 in dim 1)
        "QUANTILES": [2 * (2 + 1) / 4 - 1, 2 * 0.25 / eps - 1],
        "QUANTILE10": [2 * 2 / 2 - 1, 2 * 1.25 / 2 - 1],
        "MEAN_STD": [(2 - 1) / (2 + 1e-8), (0.25 + 2) / (0.5 + 1e-8)],
        "MIN_MAX": [2 * 5 / 8 - 1, 2 * (0.25 - 5) / eps - 1],
        "IDENTITY": [2.0, 0.25],
    }
    for mode, want in cases.items():
        got = lerobot(mode).normalize_state(x)
        assert got.dtype == np.float32, mode
        np.testing.assert_allclose(got, np.float32(want), rtol=1e-6, err_msg=mode)


def test_lerobot_unnormalise_by_hand():
    a = np.array([[-1.0, 0.5]], np.float32)
    np.testing.assert_allclose(lerobot("QUANTILES").unnormalize_actions(a),
                               [[-1.0, (1.5 * 1e-8) / 2]], rtol=1e-6)
    # MEAN_STD is undone without the eps it was normalised with, as LeRobot does
    assert lerobot("MEAN_STD").unnormalize_actions(a).tolist() == [[-1.0, -1.75]]
    np.testing.assert_allclose(lerobot("MIN_MAX").unnormalize_actions(a),
                               [[-3.0, 1.5 / 2 * 1e-8 + 5.0]], rtol=1e-6)


def test_lerobot_float32_moves_a_value_on_a_bin_edge():
    # float32 arithmetic, as LeRobot does it, against openpi's float64 with its 1e-6
    ns = NormStats(Stats.from_dict({"q01": [0.0], "q99": [3.0]}), Stats({}, "IDENTITY"),
                   "lerobot")
    op = NormStats(Stats.from_dict({"q01": [0.0], "q99": [3.0]}), Stats({}, "IDENTITY"))
    x = np.array([1.5], np.float32)  # the middle: 0 exactly in float32, just below in openpi
    assert ns.normalize_state(x)[0] == 0.0
    assert op.normalize_state(x)[0] < 0.0


def test_lerobot_needs_the_stats_dims():
    with pytest.raises(ValueError, match="state has 3 dims but its stats 2"):
        lerobot("QUANTILES").normalize_state(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"MIN_MAX normalisation of state needs \['min', 'max'\]"):
        Stats.from_dict({"mean": [0.0]}, "MIN_MAX", "state")
    with pytest.raises(ValueError, match="mode"):
        Stats.from_dict(STATE, "LOG")
    with pytest.raises(ValueError, match="openpi normalises with QUANTILES or MEAN_STD"):
        NormStats(Stats.from_dict(STATE, "MIN_MAX"), Stats({}, "IDENTITY"))


def test_crop_takes_the_box_in_fractions_of_the_image():
    img = np.arange(48 * 64 * 3, dtype=np.uint8).reshape(48, 64, 3)
    # 0.25..0.75 of 64 columns = 16..48; 0.5..1.0 of 48 rows = 24..48.
    np.testing.assert_array_equal(crop(img, (0.25, 0.5, 0.75, 1.0)), img[24:48, 16:48])
    assert crop(img, None) is img
    # A box thinner than a pixel still gives one.
    assert crop(img, (0.5, 0.5, 0.5001, 0.5001)).shape == (1, 1, 3)
    with pytest.raises(ValueError, match='HxWxC'):
        crop(img[0, :, 0], (0.0, 0.0, 1.0, 1.0))


def test_image_crops_are_checked_and_travel_in_the_config():
    from oxygen_ros.model import load_config
    from oxygen_ros.model.config import ModelConfig

    cfg = load_config('tiny', image_crops={'base_0_rgb': [0.1, 0.2, 0.9, 0.8]})
    assert cfg.crop_of('base_0_rgb') == (0.1, 0.2, 0.9, 0.8)
    assert cfg.crop_of('left_wrist_0_rgb') is None
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg  # what a checkpoint's config.json holds
    with pytest.raises(ValueError, match="names slot 'top'"):
        load_config('tiny', image_crops={'top': [0.1, 0.2, 0.9, 0.8]})
    for box in ([0.5, 0.2, 0.4, 0.8], [0.1, 0.2, 1.2, 0.8], [0.1, 0.2, 0.9], 'all'):
        with pytest.raises(ValueError, match='image_crops'):
            load_config('tiny', image_crops={'base_0_rgb': box})
