"""The compiled model runner (engine/compiled.py, model_runner.py) computes what the eager
model does: each program against the model's own phase, an engine's actions and text against
an eager engine's, and programs cached on disk serve any weights of their dims."""

import numpy as np
import pytest
import torch
from support.models import LENGTHS, MASKS, observation, tiny_model  # noqa: E402

from oxygen_ros.engine import Engine, EngineConfig, Observation, RobotInput
from oxygen_ros.engine import compiled as compiled_module
from oxygen_ros.engine.compiled import PROGRAMS, Programs, stack_mods
from oxygen_ros.model import KV
from oxygen_ros.model.rtc import Handover
from oxygen_ros.model.tokenizer import Tokenizer

torch.set_num_threads(1)
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope='module')
def cache(tmp_path_factory):
    # The build tree's cache when the tests run under colcon (CMakeLists.txt), so that the
    # other test files find these programs built; a fresh one otherwise.
    import os
    path = os.environ.get('OXYGEN_COMPILE_CACHE')
    return path or str(tmp_path_factory.mktemp('compiled'))


@pytest.fixture(scope='module')
def model():
    return tiny_model(strong=True)


@pytest.fixture(scope='module')
def programs(model, cache):
    p = Programs(model, cache)
    p.load()
    return p


def twin(kv: KV) -> KV:
    return KV([t.clone() for t in kv.k], [t.clone() for t in kv.v], kv.valid.clone(),
              kv.length.clone(), kv.next_pos.clone())


def same_cache(a: KV, b: KV):
    for x, y in zip(a.k + a.v, b.k + b.v, strict=True):
        torch.testing.assert_close(x, y, **TOL)
    assert torch.equal(a.valid, b.valid) and torch.equal(a.length, b.length)
    assert torch.equal(a.next_pos, b.next_pos)


@torch.inference_mode()
def test_prefill_matches_eager_for_mixed_cameras_and_prompts(model, programs):
    cfg = model.cfg
    eager, comp = (KV.allocate(cfg, 5, cfg.prefix_len + 6) for _ in range(2))
    batch = observation(cfg, MASKS, LENGTHS)
    h_eager = model.prefill(*batch, eager, slice(1, 4))
    h_comp = model.prefill(*batch, comp, slice(1, 4), vision=programs.vision,
                           layers=programs.layers)
    torch.testing.assert_close(h_comp, h_eager, **TOL)
    same_cache(comp, eager)
    # One observation alone, and one with no camera at all (text only).
    for masks, lengths in (([[0, 1, 1]], [17]), ([[0, 0, 0]], [5])):
        batch = observation(cfg, masks, lengths, seed=3)
        h_eager = model.prefill(*batch, eager, slice(0, 1))
        h_comp = model.prefill(*batch, comp, slice(0, 1), vision=programs.vision,
                               layers=programs.layers)
        torch.testing.assert_close(h_comp, h_eager, **TOL)
        same_cache(comp, eager)


@torch.inference_mode()
def test_causal_prompt_layers_match_eager(cache):
    model = tiny_model(prompt_attention='causal')
    p = Programs(model, cache)
    p.load(['vision', 'layers'])
    cfg = model.cfg
    eager, comp = (KV.allocate(cfg, 3, cfg.prefix_len) for _ in range(2))
    batch = observation(cfg, MASKS, LENGTHS)
    h_eager = model.prefill(*batch, eager, slice(0, 3))
    h_comp = model.prefill(*batch, comp, slice(0, 3), vision=p.vision, layers=p.layers)
    torch.testing.assert_close(h_comp, h_eager, **TOL)
    same_cache(comp, eager)


@torch.inference_mode()
def test_velocity_and_denoise_match_eager(model, programs):
    cfg = model.cfg
    kv = KV.allocate(cfg, 3, cfg.prefix_len)
    model.prefill(*observation(cfg, MASKS, LENGTHS), kv, slice(0, 3))
    noise = torch.randn(3, cfg.action_horizon, cfg.action_dim,
                        generator=torch.Generator().manual_seed(2))
    eager = model.denoise(kv, slice(0, 3), noise, 10)
    mods, dt = model.flow_schedule(10)
    lp = int(kv.length.max())
    prefix, bias, cos, sin, _ = model._denoise_inputs(kv, slice(0, 3), cfg.action_horizon, lp)
    keys = [k.transpose(-1, -2).contiguous() for k, _ in prefix]
    values = [v.contiguous() for _, v in prefix]
    x = noise.clone()
    for m in mods:
        x = x + dt * programs.velocity(x, stack_mods(m), keys, values, bias, cos, sin)
    torch.testing.assert_close(x, eager, **TOL)


@torch.inference_mode()
def test_decode_writes_the_cache_as_eager_does(model, programs):
    cfg = model.cfg
    eager = KV.allocate(cfg, 4, cfg.prefix_len + 8)
    model.prefill(*observation(cfg, MASKS, LENGTHS), eager, slice(0, 3))
    comp = twin(eager)
    rows = torch.tensor([2, 0])  # out of order, one row left alone
    for step in range(5):
        tokens = torch.tensor([7 + step, 40 - step])
        h_eager = model.decode_hidden(eager, rows, tokens)
        h_comp = programs.decode(comp, rows, tokens)
        torch.testing.assert_close(h_comp, h_eager, **TOL)
        same_cache(comp, eager)


def engines(model, **kw):
    cfg = dict(model='tiny', decode_k=2, max_requests=4, max_new_tokens=6, stop_at_eos=False,
               prompt_format='subtask', seed=5, max_question_tokens=24)
    cfg.update(kw)
    tok = Tokenizer.default()
    return (Engine(EngineConfig(**cfg, compile=False), model=model, tokenizer=tok),
            Engine(EngineConfig(**cfg, compile=True), model=model, tokenizer=tok))


def observations(cfg, n, seed=0):
    rng = np.random.default_rng(seed)
    size = cfg.vision.image_size
    for i in range(n):
        images = {s: None if (i + j) % 4 == 3 else
                  rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                  for j, s in enumerate(cfg.image_slots)}
        yield Observation(stamp=0.1 * i, images=images,
                          state=rng.uniform(-1, 1, 6).astype(np.float32),
                          prompt=['pick up the cup', 'wave'][i % 2])


@pytest.mark.parametrize('mode', ['oxygen', 'isolated'])
def test_engine_gives_the_eager_engines_actions_and_text(model, cache, mode, monkeypatch):
    monkeypatch.setenv('OXYGEN_COMPILE_CACHE', cache)
    eager, comp = engines(model, mode=mode)
    assert (eager.backend, comp.backend) == ('eager', 'compiled')
    texts = {}
    for e in (eager, comp):
        out = texts[e.backend] = {'actions': [], 'tokens': []}
        for i, obs in enumerate(observations(model.cfg, 9)):
            if i == 4:
                e.ask('is the cup in the gripper?')
            r = e.step(obs, narrate=i % 3 != 2)
            out['actions'].append(r.actions)
            out['tokens'] += [(ev.kind, ev.tokens, ev.text) for ev in r.events]
    for a, b in zip(texts['compiled']['actions'], texts['eager']['actions'], strict=True):
        np.testing.assert_allclose(a, b, **TOL)
    events = texts['eager']['tokens']
    assert texts['compiled']['tokens'] == events
    assert len(events) >= 30 and ('question', 6) in {e[:2] for e in events}
    assert len({e[2] for e in events if e[1] == 6}) > 2  # the text follows the frames


def test_fleet_and_guided_frames_match_eager(model, cache, monkeypatch):
    """Three robots in one frame (a batched prefill and denoise), then real-time chunking
    (the guided denoise runs eagerly on every backend)."""
    monkeypatch.setenv('OXYGEN_COMPILE_CACHE', cache)
    eager, comp = engines(model, robots=3, rtc=True)
    chunks = {}
    for e in (eager, comp):
        for name in 'abc':
            e.add_robot(name)
        out = chunks[e.backend] = []
        obs = list(observations(model.cfg, 9, seed=4))
        for i in range(3):
            # From the second frame on, each chunk continues the robot's last one.
            handover = Handover(1, 1) if i else None
            r = e.step_fleet({n: _input(obs[3 * i + j], handover) for j, n in enumerate('abc')})
            out += [r.results[n].actions for n in 'abc']
    assert comp.stats()['rtc_frames'] == eager.stats()['rtc_frames'] == 6
    for a, b in zip(chunks['compiled'], chunks['eager'], strict=True):
        np.testing.assert_allclose(a, b, **TOL)


def _input(obs, handover):
    return RobotInput(obs, narrate=True, handover=handover)


@torch.inference_mode()
def test_programs_load_from_the_cache_and_read_the_weights_given(model, programs, cache):
    """A second model of the same dims loads the programs built for the first (nothing is
    built), and computes with its own weights: none of the first's is frozen in."""
    assert sorted(programs.cached()) == sorted(PROGRAMS)
    other = tiny_model(seed=9, strong=True)
    again = Programs(other, cache)
    assert again.path('decode') == programs.path('decode')
    again.load()
    assert set(again.built.values()) == {0.0}
    cfg = other.cfg
    batch = observation(cfg, MASKS, LENGTHS)
    for m, p in ((model, programs), (other, again)):
        eager, comp = (KV.allocate(cfg, 3, cfg.prefix_len) for _ in range(2))
        h_eager = m.prefill(*batch, eager, slice(0, 3))
        h_comp = m.prefill(*batch, comp, slice(0, 3), vision=p.vision, layers=p.layers)
        torch.testing.assert_close(h_comp, h_eager, **TOL)
    # Different dims, different programs.
    assert Programs(tiny_model(vlm={'mlp': 96}), cache).path('decode') != programs.path('decode')


def test_a_weight_the_program_does_not_take_is_an_error(model, tmp_path, monkeypatch):
    """Were a program to read a weight it is not given, that weight would be frozen into it
    and every later checkpoint of the dims would run with it: building refuses."""
    import re
    monkeypatch.setitem(compiled_module.WEIGHTS, 'velocity',
                        re.compile(r'^(expert\.\d+\.(qkv|o|gate_up)|action_(in|out))\.'))
    p = Programs(model, tmp_path)
    with pytest.raises(RuntimeError, match=r'velocity reads tensors .*down'):
        p.load(['velocity'])
    assert not p.cached()


def test_compile_applies_to_float32_on_the_cpu_only(model, cache, monkeypatch):
    monkeypatch.setenv('OXYGEN_COMPILE_CACHE', cache)
    tok = Tokenizer.default()
    base = dict(model='tiny', max_requests=2, max_new_tokens=3, compile=True)
    assert Engine(EngineConfig(**base), model=model, tokenizer=tok).backend == 'compiled'
    assert Engine(EngineConfig(**base, graphs=True), model=model,
                  tokenizer=tok).backend == 'graphs'
    bf16 = tiny_model().to_inference('cpu', torch.bfloat16)
    assert Engine(EngineConfig(**base), model=bf16, tokenizer=tok).backend == 'eager'
    with pytest.raises(ValueError, match='float32 models on the CPU'):
        Programs(bf16)


def test_a_model_that_cannot_be_compiled_runs_eagerly_and_says_why(model, tmp_path,
                                                                    monkeypatch):
    """No C++ compiler, a full disk: the engine still starts, runs the model eagerly, and
    warns with the reason (the node's log gets it)."""
    def broken(self, names=(), workers=None):
        self.say('compiling the model for this CPU (...)')
        raise OSError('no C++ compiler found')
    monkeypatch.setattr(Programs, 'load', broken)

    class Log:
        def __init__(self):
            self.lines, self.warnings = [], []

        def info(self, text):
            self.lines.append(text)

        def warning(self, text):
            self.warnings.append(text)

    log = Log()
    cfg = EngineConfig(model='tiny', max_requests=2, max_new_tokens=3, compile=True,
                       compile_cache=str(tmp_path))
    e = Engine(cfg, model=model, tokenizer=Tokenizer.default(), log=log)
    assert e.backend == 'eager'
    assert log.warnings == ['compiling the model failed (OSError: no C++ compiler found); it '
                            'runs eagerly (compile: false skips compiling)']
    assert any('compiling the model for this CPU' in t for t in log.lines)
    obs = next(observations(model.cfg, 1))
    assert np.isfinite(e.step(obs).actions).all()


def test_other_threads_run_while_a_program_runs(model, programs):
    # The control thread must keep its 70 Hz while the engine runs a frame: a program runs
    # with the GIL released (aoti.py). A thread that wakes every half millisecond stamps the
    # time; the stamps that fall inside a program's call are the turns it got meanwhile.
    # torch's own loader runs the same program with the GIL held: no turn (that it gets
    # none shows the count can fail; 77-99 turns in 45-64 ms against 0 when written). A
    # long switch interval keeps Python from taking the GIL away from the caller on its own.
    import sys
    import threading
    import time

    images = torch.rand(600, 3, model.cfg.vision.image_size, model.cfg.vision.image_size)
    stamps, stop = [], threading.Event()

    def ticker():
        while not stop.is_set():
            time.sleep(0.0005)
            stamps.append(time.perf_counter())

    def turns(run):
        run()  # warm
        t0 = time.perf_counter()
        run()
        t1 = time.perf_counter()
        return sum(t0 < s < t1 for s in list(stamps)), t1 - t0

    held = torch._inductor.aoti_load_package(str(programs.path('vision')))
    weights = programs.weights['vision']
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    t = threading.Thread(target=ticker)
    t.start()
    try:
        ours, took = turns(lambda: programs.vision(images))
        theirs, took_held = turns(lambda: held.loader.boxed_run([*weights, images]))
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(interval)
    print(f'\nours: {ours} turns in {took * 1e3:.0f} ms; torch\'s loader: {theirs} in '
          f'{took_held * 1e3:.0f} ms')
    assert took > 0.02 and took_held > 0.02, (took, took_held)  # long enough to count turns
    # (A stray turn at a call's edge was seen once in torch's loader; 0 otherwise.)
    assert theirs <= 2, f'torch\'s loader let the thread run {theirs} times: the GIL is free'
    assert ours >= 10, f'{ours} turns in {took * 1e3:.0f} ms: the program held the GIL'
