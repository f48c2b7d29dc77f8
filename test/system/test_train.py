"""oxygen-train: the training path is the inference path. Its losses and their gradients,
taken through prefill, Pi05.velocity and Pi05.extend_rows on the KV cache, equal those of
the whole-sequence reference (Pi05._reference, openpi's layout and masks, no cache); the
ALOHA profile's encode_actions inverts decode_actions and is openpi's training transform
(restated from its source); and a run on episodes in oxygen-demos' layout writes a
checkpoint that the engine loads with checkpoint:= alone, takes its tokenizer from, and feeds
exactly the tensors training saw, and resumes bit for bit."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from oxygen_ros.model import KV, Pi05, load_config
from oxygen_ros.model.denoise import flow_times
from oxygen_ros.robot.profiles import make_profile

torch.set_num_threads(2)
h5py = pytest.importorskip('h5py')

from oxygen_ros.sim import train  # noqa: E402

# A tiny model shaped like the trained policy: one camera, the built-in vocabulary, ALOHA's
# 14 action dims, room for LeRobot's prompt with a 14-d state.
TINY = dict(config='tiny', image_slots=['base_0_rgb'], vocab=512, action_dim=14,
            action_horizon=4, max_token_len=96)


def tiny_model(seed=0, **over) -> Pi05:
    spec = {**TINY, **over}
    torch.manual_seed(seed)
    model = Pi05(load_config(spec.pop('config'), **spec))
    with torch.no_grad():  # norms start at a scale of one: perturb them so the test sees them
        for name, p in model.named_parameters():
            if p.dim() == 1 and 'norm' in name and 'vision' not in name:
                p.normal_(0.0, 0.3)
    model.pack_head = False
    return model


def batch_for(model, b=3, n=5, seed=1):
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    size = cfg.vision.image_size
    lengths = torch.tensor([cfg.max_token_len, 40, 7][:b])
    token_mask = torch.arange(cfg.max_token_len)[None] < lengths[:, None]
    tokens = torch.randint(2, cfg.vocab, (b, cfg.max_token_len), generator=g) * token_mask
    text = torch.randint(2, cfg.vocab, (b, n), generator=g)
    text_mask = torch.zeros(b, n, dtype=torch.bool)
    text_mask[0, :] = True  # a narration: every token a target
    text_mask[1, 3:] = True  # a question of 3 tokens, its answer after
    text_mask[2, 1:3] = True  # a short one, padded
    return dict(images=torch.rand(b, 1, 3, size, size, generator=g) * 2 - 1,
                image_mask=torch.ones(b, 1, dtype=torch.bool), tokens=tokens,
                token_mask=token_mask,
                actions=torch.randn(b, cfg.action_horizon, cfg.action_dim, generator=g),
                text=text, text_mask=text_mask)


def reference_losses(model, batch, noise, t: float):
    """The same losses from Pi05._reference: the whole [prefix | chunk] and [prefix | text]
    sequences at once, without a cache."""
    args = (batch['images'], batch['image_mask'], batch['tokens'], batch['token_mask'])
    x_t = t * noise + (1 - t) * batch['actions']
    v = model._reference(*args, x_t=x_t, time=t)
    flow = F.mse_loss(v, noise - batch['actions'])
    logits = model._reference(*args, generated=batch['text'][:, :-1])
    mask = batch['text_mask']
    text = F.cross_entropy(logits[mask], batch['text'][mask])
    return dict(flow=flow, text=text)


def grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward(retain_graph=True)  # the flow and text losses share the prefill
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_velocity_is_what_a_denoise_step_computes():
    model = tiny_model().to_inference('cpu')
    cfg = model.cfg
    batch = batch_for(model)
    kv = KV.allocate(cfg, 4, cfg.prefix_len)
    with torch.no_grad():
        model.prefill(batch['images'], batch['image_mask'], batch['tokens'],
                      batch['token_mask'], kv, slice(1, 4))
    noise = torch.randn(3, cfg.action_horizon, cfg.action_dim,
                        generator=torch.Generator().manual_seed(3))
    trace = []
    model.denoise(kv, slice(1, 4), noise, steps=10, trace=trace)
    times, _ = flow_times(10)
    with torch.no_grad():
        v = model.velocity(kv, slice(1, 4), noise, torch.full((3,), times[0]))
        torch.testing.assert_close(v, trace[0], atol=1e-6, rtol=1e-6)
        # One time per row: each row as if it were alone at its time.
        mixed = model.velocity(kv, slice(1, 4), noise, torch.tensor([1.0, 0.3, 0.05]))
        for i, t in enumerate((1.0, 0.3, 0.05)):
            alone = model.velocity(kv, slice(1 + i, 2 + i), noise[i:i + 1], torch.tensor([t]))
            torch.testing.assert_close(mixed[i:i + 1], alone, atol=1e-6, rtol=1e-6)
        assert (mixed[2] - v[2]).abs().max() > 1e-3  # the time matters
    with pytest.raises(ValueError, match='one time per row'):
        model.velocity(kv, slice(1, 4), noise, torch.tensor([0.5]))


def test_extend_rows_is_extend_for_each_row():
    model = tiny_model().to_inference('cpu')
    cfg = model.cfg
    batch = batch_for(model)
    text = batch['text']
    kv = KV.allocate(cfg, 6, cfg.prefix_len + 8)
    with torch.no_grad():
        for rows in (slice(0, 3), slice(3, 6)):
            model.prefill(batch['images'], batch['image_mask'], batch['tokens'],
                          batch['token_mask'], kv, rows)
        together = model.extend_rows(kv, slice(0, 3), text)
        for i in range(3):
            alone = model.extend(kv, 3 + i, text[i])
            torch.testing.assert_close(together[i, -1:], alone, atol=1e-6, rtol=1e-6)
    assert torch.equal(kv.length[:3], kv.length[3:])
    assert torch.equal(kv.next_pos[:3], kv.next_pos[3:])
    for k1 in kv.k:
        torch.testing.assert_close(k1[:3], k1[3:], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize('attention', ['bidirectional', 'causal'])
def test_training_losses_and_gradients_are_the_references(attention):
    model = tiny_model(prompt_attention=attention)
    batch = batch_for(model)
    noise = torch.randn(batch['actions'].shape, generator=torch.Generator().manual_seed(4))
    t = 0.37
    ours = train.losses(model, batch, noise, torch.full((3,), t))
    ref = reference_losses(model, batch, noise, t)
    for key in ('flow', 'text'):
        torch.testing.assert_close(ours[key], ref[key], atol=1e-5, rtol=1e-5)
        g_ours, g_ref = grads(model, ours[key]), grads(model, ref[key])
        assert set(g_ours) == set(g_ref), set(g_ours) ^ set(g_ref)
        for name in g_ref:
            torch.testing.assert_close(g_ours[name], g_ref[name], atol=1e-5, rtol=1e-4,
                                       msg=f'{key}: gradient of {name}')
        trained = {k.split('.')[0] for k, g in g_ours.items() if g.abs().max() > 0}
        if key == 'flow':  # the action loss trains the expert, the backbone and the vision
            assert {'expert', 'vlm', 'vision', 'action_in', 'time_in'} <= trained, trained
        else:  # text trains the backbone and the vision, never the action expert
            assert {'vlm', 'vision', 'embed'} <= trained, trained
            assert not trained & {'expert', 'action_in', 'action_out', 'time_in'}, trained


# -- openpi's ALOHA training transform, restated --------------------------------------------
# Physical-Intelligence/openpi src/openpi/policies/aloha_policy.py: _encode_actions_inv
# (flip the joints, _gripper_from_angular_inv: unnormalise from the servo's [-0.6213,
# 1.4910] and subtract 0.5476), then transforms.DeltaActions on the 6 + 6 arm joints
# against the decoded state.
FLIP = np.array([1, -1, -1, 1, 1, 1, 1, 1, -1, -1, 1, 1, 1, 1], dtype=np.float64)
ARMS = np.array([True] * 6 + [False] + [True] * 6 + [False])


def openpi_training_actions(normalized_actions, model_state):
    a = FLIP * np.asarray(normalized_actions, np.float64)
    a[:, [6, 13]] = a[:, [6, 13]] * (1.4910 - -0.6213) + -0.6213 - 0.5476
    a[:, ARMS] -= model_state[ARMS]
    return a


joint = st.floats(-3.0, 3.0)
grip = st.floats(0.0, 1.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(*[joint] * 6, grip, *[joint] * 6, grip), min_size=1, max_size=5),
       st.tuples(*[joint] * 6, grip, *[joint] * 6, grip))
def test_encode_actions_is_openpis_training_transform(chunk, qpos):
    profile = make_profile('aloha', adapt_to_pi=True, delta=True, normalized_gripper=False)
    act = np.array(chunk, np.float64)  # ACT's actions: joints, normalised gripper
    state = train.robot_state(np.array([qpos]))[0]  # the gripper as finger travel (m)
    model = profile.encode_actions(train.robot_targets(act), state)
    np.testing.assert_allclose(
        model, openpi_training_actions(act, profile.encode_state(state)), atol=1e-9)
    # ... and decode_actions, what the node runs, gives the targets back.
    np.testing.assert_allclose(profile.decode_actions(model, state), train.robot_targets(act),
                               atol=1e-9)


# -- a run ------------------------------------------------------------------------------------
def write_episodes(root, n=4, steps=40, size=(48, 64), seed=0):
    """Episodes in oxygen-demos' layout, written by its own writer; smooth random motions
    and pictures whose content follows the state (so there is something to learn)."""
    from oxygen_ros.sim import demos

    rng = np.random.default_rng(seed)
    t = np.linspace(0, 1, steps)[:, None]
    for k in range(n):
        a0, a1 = rng.uniform(-0.5, 0.5, (2, 14))
        qpos = (a0 + (a1 - a0) * t).astype(np.float32)
        qpos[:, [6, 13]] = np.clip(qpos[:, [6, 13]] + 0.5, 0, 1)
        action = np.roll(qpos, -1, axis=0)
        images = np.zeros((steps, *size, 3), np.uint8)
        for i in range(steps):
            x = int((qpos[i, 0] + 0.5) * (size[1] - 8))
            images[i, 10:18, x:x + 8] = (255, 0, 0)
        answers = {q: (qpos[:, 6] > 0.5) ^ (j == 1) for j, q in enumerate(demos.QUESTIONS)}
        ep = demos.Episode(seed=k, cube_pose=np.zeros(7), qpos=qpos, qvel=np.zeros_like(qpos),
                           action=action, rewards=[0.0] * steps, answers=answers,
                           images={'top': images})
        demos.write(root / f'episode_{k}.hdf5', ep)


def recipe_file(tmp_path, **over):
    recipe = dict(model=over.pop('model', TINY), cameras={'top': 'base_0_rgb'},
                  profile_options={'adapt_to_pi': True, 'delta': True,
                                   'normalized_gripper': False},
                  frame_every=2, batch=4, steps=12, lr=1e-3, min_lr=1e-4, warmup=3,
                  val_episodes=1, log_every=3, val_every=6, save_every=6, **over)
    path = tmp_path / 'recipe.yaml'
    path.write_text(json.dumps(recipe))
    return path


@pytest.fixture(scope='module')
def episodes(tmp_path_factory):
    root = tmp_path_factory.mktemp('demos')
    write_episodes(root)
    return root


# A crop of the top view: training and the engine must both cut it out before the resize.
CROP = [0.3, 0.35, 0.7, 0.75]


def test_a_run_gives_a_checkpoint_the_engine_loads_and_feeds_alike(episodes, tmp_path):
    from oxygen_ros.engine import Engine, EngineConfig, Observation

    out = tmp_path / 'run'
    cropped = {**TINY, 'image_crops': {'base_0_rgb': CROP}}
    args = ['--data', str(episodes), '--out', str(out), '--recipe',
            str(recipe_file(tmp_path, model=cropped)), '--threads', '1', '--no-progress']
    assert train.main(args) == 0
    log = [json.loads(x) for x in (out / 'log.jsonl').read_text().splitlines()]
    assert [e['step'] for e in log] == [3, 6, 9, 12]
    assert all(np.isfinite(e['flow']) and np.isfinite(e['text']) for e in log)
    assert 'val_flow' in log[1] and 'val_text' in log[-1]
    assert (out / 'loss.png').stat().st_size > 0
    ck = out / 'checkpoint'
    assert (ck / 'tokenizer.model').is_file()
    assert (ck / 'assets' / 'aloha_sim' / 'norm_stats.json').is_file()

    # The engine loads it with checkpoint:= alone and takes the tokenizer in it.
    engine = Engine(EngineConfig(checkpoint=str(ck), max_new_tokens=8, compile=False))
    assert engine.tokenizer_from == 'found in the checkpoint directory'
    assert engine.slots == ('base_0_rgb',)
    # The crop travels in the checkpoint: loading it with checkpoint:= alone applies it.
    assert engine.model_cfg.crop_of('base_0_rgb') == tuple(CROP)
    from oxygen_ros.model.checkpoint import checkpoint_slots

    assert checkpoint_slots(ck) == engine.slots  # what oxygen-eval gives the node
    # The tensors training saw for a sample are those the engine builds for the observation.
    t = train.Trainer(train.Recipe.read(recipe_file(tmp_path, model=cropped)), episodes,
                      tmp_path / 'x', 1, progress=False)
    e, step = t.train.index[5]
    with h5py.File(episodes / f'episode_{e}.hdf5') as f:
        image = f['observations/images/top'][step]
        qpos = f['observations/qpos'][step]
    b = t.batches.make(np.array([5]), torch.Generator().manual_seed(0))
    state = train.robot_state(qpos[None])[0]
    obs = Observation(stamp=0.0, images={'base_0_rgb': image},
                      state=t.profile.encode_state(state).astype(np.float32),
                      prompt=t.train.prompt)
    frame = engine.frame(obs)
    torch.testing.assert_close(frame.images.float(), b['images'], atol=0, rtol=0)
    from oxygen_ros.model.processing import prepare_image

    size = engine.model_cfg.vision.image_size
    assert not torch.equal(prepare_image(image, size, size).flatten(), b['images'].flatten())
    assert torch.equal(frame.tokens.cpu(), b['tokens'])
    assert torch.equal(frame.token_mask.cpu(), b['token_mask'])
    # Its actions are the targets the demonstration played: decoded by the robot's profile
    # from the engine's unnormalised output.
    targets = t.profile.decode_actions(engine.actions_out(b['actions'][0]), state)
    with h5py.File(episodes / f'episode_{e}.hdf5') as f:
        played = train.robot_targets(f['action'][step:step + 4])
    np.testing.assert_allclose(targets, played, atol=1e-5)


def test_a_resumed_run_is_the_run_uninterrupted(episodes, tmp_path):
    recipe = recipe_file(tmp_path)
    whole, parts = tmp_path / 'whole', tmp_path / 'parts'
    common = ['--data', str(episodes), '--recipe', str(recipe), '--threads', '1',
              '--no-progress']
    assert train.main(common + ['--out', str(whole)]) == 0
    assert train.main(common + ['--out', str(parts), '--stop-at', '5']) == 2  # not a log step
    assert train.main(common + ['--out', str(parts), '--stop-at', '6']) == 0
    assert json.loads((parts / 'state.json').read_text())['step'] == 6
    import shutil

    at6 = shutil.copytree(parts / 'checkpoint', tmp_path / 'at6')
    assert train.main(common + ['--out', str(parts)]) == 2  # a run is there: --resume
    # Another recipe (here: more steps, another schedule) does not resume it.
    assert train.main(common + ['--out', str(parts), '--resume', '--steps', '18']) == 2
    assert train.main(common + ['--out', str(parts), '--resume']) == 0
    from safetensors.torch import load_file

    a, b = (load_file(str(d / 'state.safetensors')) for d in (whole, parts))
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    la, lb = ([{k: v for k, v in json.loads(x).items() if k != 's'}
               for x in (d / 'log.jsonl').read_text().splitlines()] for d in (whole, parts))
    assert la == lb

    # From the exported checkpoint alone (what the repository keeps): the weights and the
    # step go on, the curve so far with them; AdamW restarts, so it is a continuation only.
    going = tmp_path / 'going'
    assert train.main(common + ['--out', str(going), '--start-from', str(at6)]) == 0
    lg = [json.loads(x) for x in (going / 'log.jsonl').read_text().splitlines()]
    assert [e['step'] for e in lg] == [3, 6, 9, 12]
    assert lg[:2] == [json.loads(x) for x in (at6 / 'training_log.jsonl').read_text()
                      .splitlines()]
    assert json.loads((going / 'state.json').read_text())['step'] == 12
    other = recipe_file(tmp_path, seed=1)
    assert train.main(['--data', str(episodes), '--recipe', str(other), '--threads', '1',
                       '--no-progress', '--out', str(tmp_path / 'o'), '--start-from',
                       str(at6)]) == 2  # another recipe's checkpoint
    # A longer schedule goes on from it (the shipped checkpoint trained further); one that
    # ends at or before the checkpoint's step is refused, not run as zero steps.
    longer = tmp_path / 'longer'
    recipe_file(tmp_path)  # the recipe the checkpoint was trained with, again
    assert train.main(common + ['--out', str(longer), '--start-from', str(at6),
                                '--steps', '18']) == 0
    assert json.loads((longer / 'state.json').read_text())['step'] == 18
    # The export says where its schedule was lengthened: at step 6 of the 12-step one.
    trained = json.loads((longer / 'checkpoint' / 'config.json').read_text())['training']
    assert trained['went_on_from'] == [{'step': 6, 'schedule_steps': 12}]
    assert trained['recipe']['steps'] == 18
    assert train.main(common + ['--out', str(tmp_path / 'short'), '--start-from', str(at6),
                                '--steps', '6']) == 2


def test_fine_tuning_starts_from_a_checkpoints_weights(episodes, tmp_path):
    """--init-from: a new run (here on a crop of the top view) whose weights start as those
    of a checkpoint of the same dims trained on the whole image; its step and schedule start
    at 0 and the exported checkpoint says where it came from."""
    from oxygen_ros.model.checkpoint import load_checkpoint

    base = tmp_path / 'base'
    common = ['--data', str(episodes), '--threads', '1', '--no-progress']
    assert train.main(common + ['--recipe', str(recipe_file(tmp_path)), '--out',
                                str(base)]) == 0
    cropped = recipe_file(tmp_path, model={**TINY, 'image_crops': {'base_0_rgb': CROP}})
    t = train.Trainer(train.Recipe.read(cropped), episodes, tmp_path / 'tuned', 1,
                      progress=False)
    t.init_from(base / 'checkpoint')
    theirs, _, _ = load_checkpoint(base / 'checkpoint')
    mine = dict(t.model.named_parameters())
    for k, p in theirs.named_parameters():
        assert torch.equal(mine[k].detach(), p.detach()), k
    assert t.step == 0 and t.init['step'] == 12 and t.init['image_crops'] == {}
    out = tmp_path / 'tuned2'
    assert train.main(common + ['--recipe', str(cropped), '--out', str(out), '--init-from',
                                str(base / 'checkpoint'), '--steps', '6']) == 0
    meta = json.loads((out / 'checkpoint' / 'config.json').read_text())
    assert meta['training']['init_from']['checkpoint'] == 'checkpoint'
    assert meta['training']['step'] == 6
    assert meta['oxygen']['image_crops'] == {'base_0_rgb': CROP}
    # A checkpoint trained on a crop starts another run too (its crops read from it).
    again = train.Trainer(train.Recipe.read(cropped), episodes, tmp_path / 'again', 1,
                          progress=False)
    again.init_from(out / 'checkpoint')
    assert again.init['image_crops'] == {'base_0_rgb': CROP}
    assert train.main(common + ['--recipe', str(cropped), '--out', str(tmp_path / 'both'),
                                '--init-from', str(base / 'checkpoint'), '--start-from',
                                str(base / 'checkpoint')]) == 2


def test_episodes_come_from_several_directories(episodes, tmp_path):
    """--data DIR DIR: the episodes of both, in order; the last directory's last episodes
    are held out, and the checkpoint names each file with its directory."""
    more = tmp_path / 'more'
    more.mkdir()
    write_episodes(more, n=2, seed=1)
    out = tmp_path / 'run'
    assert train.main(['--data', str(episodes), str(more), '--out', str(out), '--recipe',
                       str(recipe_file(tmp_path)), '--threads', '1', '--no-progress',
                       '--steps', '3']) == 0
    state = json.loads((out / 'state.json').read_text())
    assert state['val_files'] == ['more/episode_1.hdf5']
    assert state['train_files'] == [f'{episodes.name}/episode_{k}.hdf5' for k in range(4)] \
        + ['more/episode_0.hdf5']


def test_a_share_of_each_batch_comes_from_the_first_steps(episodes, tmp_path):
    """early_share / early_steps: that share of every batch is drawn from observations
    taken before early_steps in their episode; the rest from all of them."""
    recipe = train.Recipe.read(recipe_file(tmp_path, early_share=0.5, early_steps=6))
    t = train.Trainer(recipe, episodes, tmp_path / 'run', 1, progress=False)
    seen = []
    make = t.batches.make
    t.batches.make = lambda idx, g: (seen.append(idx.copy()), make(idx, g))[1]
    for _ in range(20):
        t.train_step()
    steps = np.array([[t.train.index[i][1] for i in idx] for idx in seen])
    assert steps.shape == (20, 4)
    assert set(steps[:, :2].ravel()) == {0, 2, 4}  # observations every 2 steps, before 6
    assert steps[:, 2:].max() >= 6  # the rest from the whole episode
    for bad in (dict(early_share=0.5), dict(early_steps=6), dict(early_share=1.0,
                                                                  early_steps=6)):
        with pytest.raises(ValueError, match='early_share'):
            train.Recipe.read(recipe_file(tmp_path, **bad))


def test_the_readout_never_reaches_an_action():
    """Pi05.readout_parameters, measured rather than read off the code: changing those
    entries, however much, leaves every layer's prefix keys and values and the velocity of
    every denoise step bit for bit as they were, while what language reads (prefill's last
    hidden state) changes; the entries beside them (the last layer's keys and values) do
    change the KV rows and the velocity."""
    model = tiny_model()
    cfg = model.cfg
    b = batch_for(model)
    noise = torch.randn(b['actions'].shape, generator=torch.Generator().manual_seed(2))
    t = torch.full((3,), 0.4)

    def run():
        kv = KV.allocate(cfg, 3, cfg.prefix_len, device='cpu')
        h = model.prefill(b['images'], b['image_mask'], b['tokens'], b['token_mask'], kv,
                          slice(0, 3))
        v = model.velocity(kv, slice(0, 3), noise, t)
        return h, [k.clone() for k in kv.k] + [v_.clone() for v_ in kv.v], v

    readout = model.readout_parameters()
    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        h0, kv0, v0 = run()
        for name, mask in readout.items():
            change = torch.randn(params[name].shape, generator=g)
            params[name].add_(change if mask is None else change * mask)
        h1, kv1, v1 = run()
        assert all(torch.equal(a, c) for a, c in zip(kv0, kv1, strict=True))
        assert torch.equal(v0, v1)
        assert (h0 - h1).abs().max() > 0.1
        last = f'vlm.{cfg.vlm.depth - 1}.qkv.weight'
        assert readout[last].any() and not readout[last].all()
        params[last][~readout[last]] += 0.05
        _, kv2, v2 = run()
    assert not torch.equal(kv2[cfg.vlm.depth - 1], kv1[cfg.vlm.depth - 1])
    assert not torch.equal(v2, v1)


def test_the_language_stage_changes_no_action(episodes, tmp_path):
    """train: language. It starts only from a trained policy (--init-from); its export keeps
    every weight outside the readout and the norm stats exactly, so the validation flow loss
    does not move, and the readout does; it resumes bit for bit like any run."""
    from oxygen_ros.model.checkpoint import load_checkpoint

    base = tmp_path / 'base'
    common = ['--data', str(episodes), '--threads', '1', '--no-progress']
    assert train.main(common + ['--recipe', str(recipe_file(tmp_path)), '--out',
                                str(base)]) == 0
    lang = recipe_file(tmp_path, train='language')
    assert train.main(common + ['--recipe', str(lang), '--out', str(tmp_path / 'none')]) == 2
    out, parts = tmp_path / 'lang', tmp_path / 'parts'
    start = ['--recipe', str(lang), '--init-from', str(base / 'checkpoint')]
    assert train.main(common + start + ['--out', str(out)]) == 0
    before, _, _ = load_checkpoint(base / 'checkpoint')
    after, _, _ = load_checkpoint(out / 'checkpoint')
    readout = before.readout_parameters()
    theirs = dict(before.named_parameters())
    moved = []
    for k, p in after.named_parameters():
        mask = readout.get(k, False)
        if mask is not False:
            moved.append(not torch.equal(p, theirs[k]))
        if mask is None:
            continue
        same = p == theirs[k]
        assert bool((same | mask).all()), k
    assert all(moved), moved
    stats = 'assets/aloha_sim/norm_stats.json'
    assert (out / 'checkpoint' / stats).read_bytes() == (base / 'checkpoint' / stats).read_bytes()
    log = [json.loads(x) for x in (out / 'log.jsonl').read_text().splitlines()]
    assert all('flow' not in e and np.isfinite(e['text']) for e in log)
    vals = [e['val_flow'] for e in log if 'val_flow' in e]
    assert len(vals) == 2 and vals[0] == vals[1]
    # Resumed from its state: the same run.
    assert train.main(common + start + ['--out', str(parts), '--stop-at', '6']) == 0
    assert train.main(common + ['--recipe', str(lang), '--out', str(parts), '--resume']) == 0
    from safetensors.torch import load_file

    a, b = (load_file(str(d / 'state.safetensors')) for d in (out, parts))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="train is 'all' or 'language'"):
        train.Recipe.read(recipe_file(tmp_path, train='readout'))
