"""The engine against LeRobot's own numbers, with LeRobot absent.

test/fixtures/lerobot_pi05 was written by LeRobot itself (tools/crosscheck_lerobot.py
--write-fixture; the versions are in its fixture.json): two tiny pi05 policy directories as
policy.save_pretrained and the processors' save_pretrained left them (QUANTILES state and
actions; MEAN_STD state with MIN_MAX actions), raw inputs (three uint8 cameras of odd sizes,
a state reaching past the stats with one value on a bin edge, a task), the noise, and what
LeRobot computed from them at each stage (preprocessor -> predict_action_chunk(noise) ->
postprocessor), with every camera and with wrist_left left out. The engine loads each
directory as a user would and must give the same numbers.
"""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from support.paths import FIXTURES  # noqa: E402

from oxygen_ros.engine import Engine, EngineConfig, Observation

torch.set_num_threads(1)

FIXTURE = FIXTURES / 'lerobot_pi05'
META = json.loads((FIXTURE / 'fixture.json').read_text())
INPUTS = load_file(str(FIXTURE / 'inputs.safetensors'))
EXPECTED = load_file(str(FIXTURE / 'expected.safetensors'))
POLICIES = sorted(META['policies'])
CASES = sorted(META['cases'])
# Largest differences measured against LeRobot 0.6.1 (fp32, CPU): final actions 3.8e-6 (max
# |actions| 33), the same chunk in model space 4.8e-7; images, normalised state and the
# postprocessor alone 0; prompt tokens identical. The bounds leave room for another CPU's
# kernels and stay far below what a wrong convention or statistic moves (1.7e-2 and up).
# 1e-4 would be too loose: openpi's fp32-accumulated time grid in place of LeRobot's moves the
# final actions by only 7.5e-5 (2.4e-5 in model space), and both bounds here catch it.
TOL_ACTIONS = 2e-5
TOL_MODEL = 5e-6  # the chunk before unnormalisation
TOL_EXACT = 1e-6  # images, normalised state, the postprocessor alone
PRE_STATS = 'policy_preprocessor_step_3_normalizer_processor.safetensors'
POST_STATS = 'policy_postprocessor_step_0_unnormalizer_processor.safetensors'


def engine(directory, **kw):
    return Engine(EngineConfig(checkpoint=str(directory), model=str(FIXTURE / 'dims.yaml'),
                               tokenizer=str(FIXTURE / 'tokenizer.model'), seed=0, **kw))


def observation(case):
    missing = META['cases'][case]
    images = {c: INPUTS[f'image.{c}'] for c in META['cameras'] if c not in missing}
    return Observation(0.0, images, INPUTS['state'], META['task'])


def actions(eng, case):
    return np.asarray(eng.step(observation(case), noise=INPUTS['noise']).actions)


def maxdiff(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape
    return float(np.abs(a - b).max())


def test_fixture_is_what_lerobot_wrote():
    # The fixture itself: LeRobot's files, small, and the outputs it recorded non-trivial.
    assert META['versions']['lerobot'] == '0.6.1'
    size = sum(f.stat().st_size for f in FIXTURE.rglob('*') if f.is_file())
    assert size < 2_000_000
    for name in POLICIES:
        files = {f.name for f in (FIXTURE / name).iterdir()}
        assert files == {'config.json', 'model.safetensors', 'policy_preprocessor.json',
                         'policy_postprocessor.json', PRE_STATS, POST_STATS}
        cfg = json.loads((FIXTURE / name / 'config.json').read_text())
        assert cfg['type'] == 'pi05' and cfg['paligemma_variant'] == 'gemma_2b'
        want = META['policies'][name]['normalization_mapping']
        assert {k: cfg['normalization_mapping'][k] for k in want} == want
    a = EXPECTED['quantiles.all.actions']
    assert a.shape == (META['chunk_size'], META['action_dim']) and np.abs(a).max() > 1.0
    # Leaving a camera out changes what LeRobot computes, so that case checks something.
    assert maxdiff(a, EXPECTED['quantiles.no_wrist_left.actions']) > 1e-2


@pytest.mark.parametrize('name', POLICIES)
def test_engine_reads_the_policy(name):
    eng = engine(FIXTURE / name)
    assert eng.conventions == 'lerobot'
    assert eng.slots == tuple(META['cameras'])
    assert (eng.state_dim, eng.action_dim, eng.model_action_dim) == (
        META['state_dim'], META['action_dim'], META['model_action_dim'])
    assert (eng.action_horizon, eng.n_action_steps) == (META['chunk_size'],
                                                        META['n_action_steps'])
    norm = META['policies'][name]['normalization_mapping']
    assert eng.weights['layout'] == 'lerobot'
    assert sorted(eng.weights['stats_files']) == sorted([PRE_STATS, POST_STATS])
    assert (eng.norm.state.mode, eng.norm.actions.mode) == (norm['STATE'], norm['ACTION'])


@pytest.mark.parametrize('case', CASES)
@pytest.mark.parametrize('name', POLICIES)
def test_preprocessing_matches_lerobot(name, case):
    """What LeRobot's preprocessor and _preprocess_images hand the model: the normalised
    state, the prompt's tokens (state discretised into it) and the images."""
    eng = engine(FIXTURE / name)
    key = f'{name}.{case}'
    state = eng.norm.normalize_state(INPUTS['state'])
    assert maxdiff(state, EXPECTED[f'{key}.state']) <= TOL_EXACT
    frame = eng.frame(observation(case), INPUTS['noise'])
    assert np.array_equal(frame.tokens[0].numpy(), EXPECTED[f'{key}.tokens'])
    assert np.array_equal(frame.token_mask[0].numpy(), EXPECTED[f'{key}.token_mask'])
    present = [c not in META['cases'][case] for c in eng.slots]
    assert frame.image_mask[0].tolist() == present
    for slot, img, shown in zip(eng.slots, frame.images[0], present, strict=True):
        if shown:  # a missing camera is masked out of attention: its pixels never count
            assert maxdiff(img.numpy(), EXPECTED[f'image.{slot}']) <= TOL_EXACT, slot


@pytest.mark.parametrize('name', POLICIES)
def test_postprocessor_matches_lerobot(name):
    # The unnormalisation alone, on LeRobot's own model-space chunk.
    eng = engine(FIXTURE / name)
    for case in CASES:
        chunk = torch.from_numpy(EXPECTED[f'{name}.{case}.chunk'])
        out = eng.actions_out(chunk)
        assert maxdiff(out, EXPECTED[f'{name}.{case}.actions']) <= TOL_EXACT, case


@pytest.mark.parametrize('case', CASES)
@pytest.mark.parametrize('name', POLICIES)
def test_actions_match_lerobot(name, case):
    """End to end: raw observation and noise -> the engine's actions, against LeRobot's
    preprocessor -> predict_action_chunk(noise) -> postprocessor."""
    eng = engine(FIXTURE / name)
    got = actions(eng, case)
    want = EXPECTED[f'{name}.{case}.actions']
    assert got.shape == want.shape
    assert maxdiff(got, want) <= TOL_ACTIONS, maxdiff(got, want)
    # In model space too, where the large action stats do not scale the difference up.
    model = eng.norm.normalize_actions(got)
    assert maxdiff(model, EXPECTED[f'{name}.{case}.chunk']) <= TOL_MODEL


@pytest.mark.parametrize('case', CASES)
def test_openpi_conventions_do_not_match(case):
    # The quantile directory read with openpi's image resize, quantile formula and time grid
    # must not pass for LeRobot's: the comparison above can fail.
    got = actions(engine(FIXTURE / 'quantiles', conventions='openpi'), case)
    assert maxdiff(got, EXPECTED[f'quantiles.{case}.actions']) > 100 * TOL_ACTIONS


def test_openpi_conventions_refuse_min_max():
    # openpi has no MIN_MAX: asked to read such a directory its way, the engine says so
    # instead of unnormalising with some other formula.
    with pytest.raises(ValueError, match='not MIN_MAX'):
        engine(FIXTURE / 'mean_std_min_max', conventions='openpi')


def perturbed(tmp_path, name, stats_file, key, dim, delta):
    """A copy of a fixture policy with one statistic moved."""
    directory = tmp_path / name
    shutil.copytree(FIXTURE / name, directory)
    stats = load_file(str(directory / stats_file))
    stats[key] = stats[key].copy()
    stats[key][dim] += delta
    save_file(stats, str(directory / stats_file))
    return directory


@pytest.mark.parametrize('name, stat', [('quantiles', 'q99'), ('mean_std_min_max', 'max')])
def test_a_moved_action_statistic_is_caught(tmp_path, name, stat):
    # One action dim's upper statistic raised by 0.05: that dim moves past the bound, the
    # others stay within it (the comparison is per element, not a loose aggregate).
    dim = 3
    directory = perturbed(tmp_path, name, POST_STATS, f'action.{stat}', dim, 0.05)
    got = actions(engine(directory), 'all')
    want = EXPECTED[f'{name}.all.actions']
    assert maxdiff(got[:, dim], want[:, dim]) > 10 * TOL_ACTIONS
    others = [d for d in range(want.shape[1]) if d != dim]
    assert maxdiff(got[:, others], want[:, others]) <= TOL_ACTIONS


@pytest.mark.parametrize('name, stat', [('quantiles', 'q01'), ('mean_std_min_max', 'mean')])
def test_a_moved_state_statistic_is_caught(tmp_path, name, stat):
    # The state only reaches the model as discretised prompt tokens: moving one statistic
    # changes that token, and so the actions.
    # Dim 1: dim 0 lies past the stats' range, where a small move keeps the last bin.
    directory = perturbed(tmp_path, name, PRE_STATS, f'observation.state.{stat}', 1, 0.3)
    eng = engine(directory)
    frame = eng.frame(observation('all'), INPUTS['noise'])
    assert not np.array_equal(frame.tokens[0].numpy(), EXPECTED[f'{name}.all.tokens'])
    got = actions(eng, 'all')
    assert maxdiff(got, EXPECTED[f'{name}.all.actions']) > 10 * TOL_ACTIONS
