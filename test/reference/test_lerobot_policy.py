"""A LeRobot pi05 policy directory, written here file by file as LeRobot 0.6 writes one
(config.json, model.safetensors with the "model." prefix, the processor JSON files and their
stats safetensors), loads with its cameras, dims, horizon and statistics; the numbers are
checked against hand computations. tools/crosscheck_lerobot.py compares against LeRobot."""

import math

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file as save_np
from support.lerobot import (  # noqa: E402
    ACTION_DIM,
    ACTION_STATS,
    CAMERAS,
    CHUNK,
    DENOISE,
    MAPS,
    N_STEPS,
    POST_STATS,
    PRE_STATS,
    STATE_DIM,
    STATE_STATS,
    TOKENS,
    stats_tensors,
    write_policy,
)
from support.paths import FIXTURES  # noqa: E402

from oxygen_ros.engine import Engine, EngineConfig, Observation
from oxygen_ros.model import load_config
from oxygen_ros.model.checkpoint import CheckpointError
from oxygen_ros.model.lerobot_policy import PolicyError
from oxygen_ros.model.tokenizer import Tokenizer

torch.set_num_threads(1)


def engine(root, **kw):
    # Eager: these tests check what is read from the directory; test_lerobot_fixture runs a
    # LeRobot policy compiled against LeRobot's own numbers.
    cfg = dict(checkpoint=str(root), model='tiny', seed=0, max_requests=1, max_new_tokens=2,
               compile=False)
    cfg.update(kw)
    return Engine(EngineConfig(**cfg), tokenizer=Tokenizer.default())


def observation(state=(0.2, -2.2, 9.9, -0.7), missing=()):
    rng = np.random.default_rng(1)
    images = {c: rng.integers(0, 256, (30 + 17 * i, 70, 3), dtype=np.uint8)
              for i, c in enumerate(CAMERAS) if c not in missing}
    return Observation(0.0, images, np.asarray(state, np.float32), 'pick_up the cup')


def noise(seed=2):
    return np.random.default_rng(seed).standard_normal((CHUNK, 8)).astype(np.float32)


def test_facts_come_from_the_directory(tmp_path, weights):
    eng = engine(write_policy(tmp_path / 'p', weights))
    assert eng.slots == CAMERAS
    # What oxygen-eval reads without the weights, the policy's cameras too.
    from oxygen_ros.model.checkpoint import checkpoint_slots

    assert checkpoint_slots(tmp_path / 'p', load_config('tiny')) == CAMERAS
    assert (eng.state_dim, eng.action_dim, eng.model_action_dim) == (STATE_DIM, ACTION_DIM, 8)
    assert (eng.action_horizon, eng.n_action_steps, eng.denoise_steps) == (CHUNK, N_STEPS,
                                                                          DENOISE)
    assert eng.model_cfg.max_token_len == TOKENS and eng.model_cfg.time_grid == 'lerobot'
    assert eng.conventions == 'lerobot'
    # the tiny config's own horizon, token length and slots were all replaced
    tiny = load_config('tiny')
    assert (tiny.action_horizon, tiny.max_token_len, len(tiny.image_slots)) == (4, 24, 3)
    w = eng.weights
    assert w['layout'] == 'lerobot' and w['path'].endswith('model.safetensors')
    assert w['stats_files'] == [PRE_STATS, POST_STATS]
    assert w['normalization'] == {'state': 'QUANTILES', 'actions': 'QUANTILES'}
    # an explicit step count wins over the checkpoint's
    assert engine(tmp_path / 'p', denoise_steps=3).denoise_steps == 3


def by_hand_bins(state, norm_map):
    s = {k: np.asarray(v, np.float64) for k, v in STATE_STATS.items()}
    if norm_map['STATE'] == 'QUANTILES':
        y = 2 * (state - s['q01']) / (s['q99'] - s['q01']) - 1
    else:
        y = (state - s['mean']) / (s['std'] + 1e-8)
    return [-1 if v < -1 else min(255, math.floor((v + 1) * 128)) for v in y]


@pytest.mark.parametrize('kind', MAPS)
def test_state_is_normalised_and_binned_at_the_robot_dims(tmp_path, weights, kind):
    eng = engine(write_policy(tmp_path / 'p', weights, MAPS[kind]))
    obs = observation()
    f = eng.frame(obs)
    text = eng.tokenizer.decode(f.tokens[0][f.token_mask[0]].tolist())
    bins = by_hand_bins(obs.state.astype(np.float64), MAPS[kind])
    assert len(set(bins)) == 4 and (-1 in bins or 255 in bins or kind == 'mean_std')
    assert text == f'Task: pick up the cup, State: {" ".join(map(str, bins))};\nAction: '


@pytest.mark.parametrize('kind', MAPS)
def test_actions_are_unnormalised_and_cut_to_the_robot_dims(tmp_path, weights, kind):
    root = write_policy(tmp_path / 'p', weights, MAPS[kind])
    # The state is not in the subtask prompt, so both engines see the same model input.
    raw = engine(root, normalize=False, prompt_format='subtask').step(
        observation(), noise=noise()).actions
    normed = engine(root, prompt_format='subtask')
    got = normed.step(observation(), noise=noise()).actions
    assert raw.shape == got.shape == (CHUNK, ACTION_DIM)
    a = {k: np.asarray(v, np.float64) for k, v in ACTION_STATS.items()}
    if kind == 'quantiles':
        expected = (raw + 1.0) * (a['q99'] - a['q01']) / 2.0 + a['q01']
    else:
        expected = raw * a['std'] + a['mean']  # LeRobot undoes MEAN_STD without its eps
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert np.abs(got - raw).max() > 0.5
    # the given noise is what was sampled from: again the same, another noise not
    assert np.array_equal(normed.step(observation(), noise=noise()).actions, got)
    assert not np.allclose(normed.step(observation(), noise=noise(3)).actions, got)


def test_a_missing_camera_is_masked(tmp_path, weights):
    eng = engine(write_policy(tmp_path / 'p', weights))
    f = eng.frame(observation(missing=('front',)))
    assert f.image_mask.tolist() == [[False, True]]
    assert eng.step(observation(missing=('front',)), noise=noise()).actions.shape == (CHUNK,
                                                                                      ACTION_DIM)
    with pytest.raises(ValueError, match='unknown image slots'):
        eng.frame(Observation(0.0, {'base_0_rgb': None}, np.zeros(4, np.float32), 'x'))


def test_wrong_state_and_noise_are_refused(tmp_path, weights):
    eng = engine(write_policy(tmp_path / 'p', weights))
    with pytest.raises(ValueError, match='state has 5 dims; the checkpoint expects 4'):
        eng.frame(observation(state=(0.0,) * 5))
    with pytest.raises(ValueError, match='state has 3 dims'):
        eng.frame(observation(state=(0.0,) * 3))
    with pytest.raises(ValueError, match=r'noise must be a finite \[6, 8\]'):
        eng.step(observation(), noise=np.zeros((CHUNK, ACTION_DIM)))
    bad = noise()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match='noise must be a finite'):
        eng.step(observation(), noise=bad)


def test_missing_stats_fail_loudly_unless_asked(tmp_path, weights):
    root = write_policy(tmp_path / 'p', weights, stats=False)
    with pytest.raises(PolicyError) as err:
        engine(root)
    msg = str(err.value)
    assert 'no normalisation stats' in msg and 'policy_preprocessor.json' in msg
    assert 'observation.state' in msg and 'normalize' in msg
    eng = engine(root, normalize=False)
    assert eng.norm is None and eng.weights['normalization'] is None
    assert eng.step(observation(), noise=noise()).actions.shape == (CHUNK, ACTION_DIM)


def test_stats_the_mode_needs_must_be_there(tmp_path, weights):
    root = write_policy(tmp_path / 'p', weights)
    t = stats_tensors()
    del t['observation.state.q99']
    save_np(t, str(root / PRE_STATS))
    with pytest.raises(ValueError, match=r"QUANTILES normalisation of observation.state.*q99"):
        engine(root)


def test_variants_the_tensors_lack_need_the_model_dims(tmp_path, weights):
    root = write_policy(tmp_path / 'p', weights)
    # config.json says gemma_2b / gemma_300m; the tensors are the tiny config's
    with pytest.raises(CheckpointError, match='give the dims as a model config'):
        engine(root, model='')
    with pytest.raises(CheckpointError, match="does not match config 'small'") as err:
        engine(root, model='small')  # dims are checked strictly against the tensors
    assert 'leave `model` empty' in str(err.value)


def edit_meta(key, value):
    def edit(meta, pre, post):
        meta[key] = value
    return edit


@pytest.mark.parametrize('edit, match', [
    (edit_meta('type', 'pi0'), "policy type 'pi0'"),
    (edit_meta('use_relative_actions', True), 'use_relative_actions'),
    (edit_meta('image_resolution', [224, 224]), 'image_resolution'),
    (edit_meta('min_period', 0.01), 'min_period'),
    (edit_meta('n_action_steps', CHUNK + 1), 'n_action_steps'),
    (lambda m, pre, post: m['input_features'].update(
        {'observation.environment_state': {'type': 'ENV', 'shape': [3]}}),
     'observation.environment_state'),
    (lambda m, pre, post: pre['steps'].insert(2, {'registry_name': 'image_crop',
                                                  'config': {}}), "'image_crop'"),
    (lambda m, pre, post: pre['steps'][0]['config'].update({'rename_map': {'a': 'b'}}),
     'renaming'),
    (lambda m, pre, post: pre['steps'][5]['config'].update({'max_length': 10}), 'tokenizer'),
    (lambda m, pre, post: pre['steps'][3]['config']['norm_map'].update({'VISUAL': 'MEAN_STD'}),
     'normalising images'),
    (lambda m, pre, post: post['steps'][0]['config']['norm_map'].update({'ACTION': 'LOG'}),
     'LOG'),
])
def test_what_is_not_reproduced_is_refused(tmp_path, weights, edit, match):
    root = write_policy(tmp_path / 'p', weights, edit=edit)
    with pytest.raises(ValueError, match=match):
        engine(root)


def test_conventions_can_be_overridden(tmp_path, weights):
    root = write_policy(tmp_path / 'p', weights)
    eng = engine(root, conventions='openpi')
    assert eng.conventions == 'openpi' and eng.norm.conventions == 'openpi'
    assert eng.model_cfg.time_grid == 'openpi'
    lerobot = engine(root).step(observation(), noise=noise()).actions
    openpi = eng.step(observation(), noise=noise()).actions
    assert not np.allclose(openpi, lerobot, atol=1e-3)


def test_a_policy_without_its_tokenizer_names_the_one_its_preprocessor_loads(tmp_path, weights):
    """The tiny model's 1024 rows are no tokenizer's here; what is looked for is named, and
    LeRobot's saved tokenizer step (a folder the preprocessor names) is looked in."""
    spm = FIXTURES / 'lerobot_pi05' / 'tokenizer.model'

    def load(root):
        return Engine(EngineConfig(checkpoint=str(root), model='tiny', max_requests=1,
                                   max_new_tokens=2, compile=False))

    root = write_policy(tmp_path / 'p', weights)
    with pytest.raises(CheckpointError, match=r'1024-entry vocabulary but no tokenizer .* its '
                       r'policy_preprocessor.json names google/paligemma-3b-pt-224'):
        load(root)

    def saved_tokenizer(meta, pre, post):  # as LeRobot's save_artifacts records it
        pre['steps'][5]['config']['tokenizer_name'] = 'tokenizer'

    root = write_policy(tmp_path / 'q', weights, edit=saved_tokenizer)
    (root / 'tokenizer').mkdir()
    (root / 'tokenizer' / 'tokenizer.json').write_text('{}')
    with pytest.raises(CheckpointError, match=r'its tokenizer/ has no tokenizer.model; a '
                       r'tokenizer.json is not read'):
        load(root)
    (root / 'tokenizer' / 'tokenizer.model').write_bytes(spm.read_bytes())
    with pytest.raises(CheckpointError, match=r'tokenizer/tokenizer.model \(found in the '
                       r'checkpoint directory\) has 512 pieces but .* 1024-entry vocabulary'):
        load(root)
