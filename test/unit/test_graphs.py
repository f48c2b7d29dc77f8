"""Static-shape phases (what CUDA graphs capture) give today's actions and tokens on the CPU,
and trace as one graph each, which capture needs."""

import numpy as np
import pytest
import torch
from support.models import tiny_model  # noqa: E402

from oxygen_ros.engine import Engine, EngineConfig, Observation
from oxygen_ros.engine.graphs import StaticPhases, batch_buckets, denoise_buckets
from oxygen_ros.engine.requests import Request
from oxygen_ros.model import KV, load_config
from oxygen_ros.model.rtc import Handover
from oxygen_ros.model.tokenizer import Tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope='module')
def model():
    # Layers strong enough that greedy text depends on the prefix, so a wrong cache shows.
    return tiny_model(strong=True)


def prefill_rows(model, kv, layouts, seed=0):
    """Row i gets a prefix with layouts[i] = (cameras present, valid text tokens)."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    s, size, n = len(cfg.image_slots), cfg.vision.image_size, cfg.max_token_len
    for row, (cams, text) in enumerate(layouts):
        images = torch.rand(1, s, 3, size, size, generator=g) * 2 - 1
        image_mask = torch.zeros(1, s, dtype=torch.bool)
        image_mask[0, list(cams)] = True
        tokens = torch.randint(2, cfg.vocab, (1, n), generator=g)
        token_mask = (torch.arange(n) < text)[None]
        model.prefill(images, image_mask, tokens, token_mask, kv, slice(row, row + 1))


def copy(kv: KV) -> KV:
    return KV([t.clone() for t in kv.k], [t.clone() for t in kv.v], kv.valid.clone(),
              kv.length.clone(), kv.next_pos.clone())


LAYOUTS = [((0, 1, 2), 24), ((0,), 9), ((1, 2), 3), ((), 17)]  # cameras, text tokens


def test_buckets_by_hand():
    cfg = load_config('tiny')  # 16 tokens per image, 24 text tokens: quarters of 6
    cols = denoise_buckets(cfg, cfg.prefix_len)
    assert cols == sorted({c * 16 + t for c in range(4) for t in (6, 12, 18, 24)})
    assert cols[0] == 6 and cols[-1] == cfg.prefix_len == 72
    assert denoise_buckets(cfg, 40)[-1] == 40  # never past the KV rows
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(1) == [1]


@torch.inference_mode()
def test_static_denoise_matches_eager_for_mixed_prefixes(model):
    cfg = model.cfg
    kv = KV.allocate(cfg, len(LAYOUTS), cfg.prefix_len + 5)
    prefill_rows(model, kv, LAYOUTS)
    lengths = kv.length.tolist()
    assert len(set(lengths)) == len(LAYOUTS)  # four different prefix lengths
    noise = torch.randn(len(LAYOUTS), cfg.action_horizon, cfg.action_dim,
                        generator=torch.Generator().manual_seed(1))
    mods, dtime = model.flow_schedule(10)
    buckets = denoise_buckets(cfg, kv.max_len)
    for row, length in enumerate(lengths):
        eager = model.denoise(kv, slice(row, row + 1), noise[row:row + 1], 10)
        for cols in [c for c in buckets if c >= length][:2] + [kv.max_len]:
            static = model.denoise_static(kv, torch.tensor([row]), noise[row:row + 1], cols,
                                          mods, dtime)
            torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)
    # Rows gathered in any order, several at once.
    order = torch.tensor([3, 0, 2])
    static = model.denoise_static(kv, order, noise[order], kv.max_len, mods, dtime)
    for i, row in enumerate(order.tolist()):
        eager = model.denoise(kv, slice(row, row + 1), noise[row:row + 1], 10)
        torch.testing.assert_close(static[i:i + 1], eager, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_padded_decode_matches_eager_and_leaves_the_pad_row(model):
    cfg = model.cfg
    eager_kv = KV.allocate(cfg, 5, cfg.prefix_len + 6)
    prefill_rows(model, eager_kv, LAYOUTS)
    static_kv = copy(eager_kv)
    pad = 4  # a row nobody reads, as the cache's scratch row is
    before = static_kv.length[pad].item(), static_kv.next_pos[pad].item()
    g = torch.Generator().manual_seed(2)
    # Rows join and leave: the live set changes every step, padded to 4 entries.
    for live_rows in ([0, 2], [0, 1, 2], [1], [3, 1, 0], [2, 3]):
        tokens = torch.randint(2, cfg.vocab, (len(live_rows),), generator=g)
        eager = model.decode_hidden(eager_kv, torch.tensor(live_rows), tokens)
        n = len(live_rows)
        rows = torch.tensor(live_rows + [pad] * (4 - n))
        toks = torch.cat((tokens, torch.zeros(4 - n, dtype=torch.long)))
        live = torch.arange(4) < n
        static = model.decode_hidden(static_kv, rows, toks, static_kv.max_len, live)
        assert torch.isfinite(static).all()  # padding attends somewhere: no NaN anywhere
        torch.testing.assert_close(static[:n], eager, rtol=1e-5, atol=1e-5)
    for name in ('valid', 'length', 'next_pos'):
        assert torch.equal(getattr(static_kv, name)[:4], getattr(eager_kv, name)[:4]), name
    assert (static_kv.length[pad].item(), static_kv.next_pos[pad].item()) == before
    assert not static_kv.valid[pad].any()
    for layer in range(static_kv.depth):
        for a, b in ((static_kv.k, eager_kv.k), (static_kv.v, eager_kv.v)):
            valid = eager_kv.valid[:4, None, :, None].expand_as(a[layer][:4])
            torch.testing.assert_close(a[layer][:4][valid], b[layer][:4][valid])


def observations(cfg, n, seed=0):
    """Frames whose prefixes differ: a camera masked on some, prompts of other lengths."""
    rng = np.random.default_rng(seed)
    size = cfg.vision.image_size
    prompts = ['wave', 'open the drawer and put the towel inside it', 'pick up the cup']
    for i in range(n):
        missing = {1: 'left_wrist_0_rgb', 2: 'base_0_rgb'}.get(i % 4)
        images = {s: None if s == missing else
                  rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                  for s in cfg.image_slots}
        yield Observation(stamp=float(i), images=images,
                          state=rng.uniform(-1, 1, 6).astype(np.float32),
                          prompt=prompts[i % len(prompts)])


def engine(model, **kw):
    # Eager unless told: the static phases are checked against the model's own.
    cfg = dict(model='tiny', mode='oxygen', decode_k=2, max_requests=4, max_new_tokens=5,
               stop_at_eos=False, prompt_format='subtask', seed=7, compile=False)
    cfg.update(kw)
    return Engine(EngineConfig(**cfg), model=model, tokenizer=Tokenizer.default())


def run(eng, n, narrate=lambda i: True):
    """Actions per frame, greedy token ids per request (in start order), batch sizes."""
    actions, tokens, batches = [], {}, []
    for i, obs in enumerate(observations(eng.model_cfg, n)):
        f = eng.frame(obs)
        request = Request(stamp=obs.stamp, max_new_tokens=eng.cfg.max_new_tokens,
                          stop_at_eos=False) if narrate(i) else None
        out = eng.scheduler.step_batch(f, [[request] if request is not None else []])
        actions.append(out.actions[0].clone())
        for r, t, _, _ in out.tokens:
            tokens.setdefault(r.stamp, []).append(t)
        batches += out.timing['batches']
    return actions, tokens, batches


@pytest.mark.parametrize('kw', [
    dict(mode='oxygen', decode_k=2),
    dict(mode='oxygen', decode_k=1, max_new_tokens=7, max_requests=5),
    # Adaptive k with a budget no frame reaches: its steps follow the requests' pace alone,
    # not measured times, which differ between the two runs (a loaded machine once ran
    # out of budget in one and not the other).
    dict(mode='oxygen', decode_k=0, frame_budget_ms=1e9),
    dict(mode='shared_kv'),
    dict(mode='isolated'),
])
def test_engine_with_graphs_gives_the_same_actions_and_tokens(model, kw):
    narrate = lambda i: i % 5 != 3  # noqa: E731 - some frames start no request
    a_eager, t_eager, b_eager = run(engine(model, **kw), 14, narrate)
    static = engine(model, graphs=True, **kw)
    a_static, t_static, b_static = run(static, 14, narrate)
    for x, y in zip(a_static, a_eager, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert t_static == t_eager and len(t_eager) == 11
    assert len({tuple(t) for t in t_eager.values()}) > 3  # the text follows the frame
    if kw['mode'] == 'oxygen' and kw['decode_k']:
        assert b_static == b_eager
        # Batches between buckets ran padded.
        assert set(b_eager) - set(static.scheduler.runner.static.batches)


def test_questions_with_graphs(model):
    """Questions (a row copy and an extension pass) decode in the static batch as they do
    in the dynamic one."""
    def answers(eng):
        texts = {}
        for i, obs in enumerate(observations(eng.model_cfg, 8)):
            if i % 2 == 0:
                eng.ask(['where is the cup?', 'is the drawer open?'][i % 4 // 2])
            for e in eng.step(obs, narrate=i % 3 == 0).events:
                texts.setdefault(e.request_id, []).append((e.kind, e.text, e.tokens))
        return list(texts.values())

    kw = dict(max_question_tokens=48, max_new_tokens=6, decode_k=2)
    eager, static = answers(engine(model, **kw)), answers(engine(model, graphs=True, **kw))
    assert static == eager
    assert sum(kinds[0][0] == 'question' for kinds in eager) == 4


def test_guided_frames_fall_back_to_eager(model):
    def chunks(eng):
        obs = list(observations(eng.model_cfg, 4))
        out = [eng.step(obs[0]).actions]
        out += [eng.step(o, narrate=True, handover=Handover(3, 1)).actions for o in obs[1:]]
        return out, eng.guided

    eager, guided = chunks(engine(model, rtc=True))
    static, guided_static = chunks(engine(model, rtc=True, graphs=True))
    assert guided == guided_static == 3
    for x, y in zip(static, eager, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_static_phases_trace_without_graph_breaks(model):
    cfg = model.cfg
    kv = KV.allocate(cfg, 3, cfg.prefix_len + 4)
    prefill_rows(model, kv, LAYOUTS[:2])
    mods, dtime = model.flow_schedule(10)
    noise = torch.randn(1, cfg.action_horizon, cfg.action_dim)
    torch._dynamo.reset()
    denoise = (kv, torch.tensor([1]), noise, kv.max_len, mods, dtime)
    explain = torch._dynamo.explain(model.denoise_static)(*denoise)
    assert (explain.graph_count, explain.graph_break_count) == (1, 0), explain.break_reasons
    # fullgraph=True fails on any break; the traced graph computes what the eager call does.
    compiled = torch.compile(model.denoise_static, fullgraph=True, backend='eager')
    torch.testing.assert_close(compiled(*denoise), model.denoise_static(*denoise))

    decode = (torch.tensor([0, 1, 2]), torch.tensor([5, 6, 0]), kv.max_len,
              torch.tensor([True, True, False]))
    explain = torch._dynamo.explain(model.decode_hidden)(kv, *decode)
    assert (explain.graph_count, explain.graph_break_count) == (1, 0), explain.break_reasons
    # Each call appends to rows 0 and 1: run both from the same cache state.
    twin = copy(kv)
    compiled = torch.compile(model.decode_hidden, fullgraph=True, backend='eager')
    torch.testing.assert_close(compiled(kv, *decode)[:2], model.decode_hidden(twin, *decode)[:2])
    assert torch.equal(kv.length, twin.length) and torch.equal(kv.valid, twin.valid)


def test_static_phases_refuse_what_has_no_bucket(model):
    eng = engine(model, graphs=True, max_requests=2)
    phases: StaticPhases = eng.scheduler.runner.static
    with torch.inference_mode(), pytest.raises(ValueError, match='decode batch 3'):
        phases.decode_hidden([0, 1, 2], [5, 5, 5])


def test_graphs_config_is_checked():
    with pytest.raises(ValueError, match='parallel'):
        EngineConfig(graphs=True, mode='parallel')
