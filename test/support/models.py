"""The tiny random pi0.5 the unit tests run, and inputs for it."""
import torch

from oxygen_ros.engine import Engine, EngineConfig
from oxygen_ros.engine.ask import Asks
from oxygen_ros.model import ModelConfig, Pi05, load_config


def tiny_model(seed: int = 0, strong: bool = False, **overrides) -> Pi05:
    """The `tiny` config with random weights (torch seed `seed`). Gemma's norms start at
    zero (a scale of one): they are perturbed so the tests see them. `strong`: layers strong
    enough that greedy text depends on the prefix (at their initial scale the layers add
    little to a token's own embedding, which is also the output layer, so every row would
    repeat its last token and a wrong KV row or question would not show in the text)."""
    torch.manual_seed(seed)
    model = Pi05(load_config('tiny', **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and 'norm' in name and 'vision' not in name:
                p.normal_(0.0, 0.3)
        if strong:
            for blk in model.vlm:
                blk.qkv.weight.mul_(3.0)
                blk.o.weight.mul_(30.0)
                blk.down.weight.mul_(30.0)
    return model.to_inference('cpu')


def observation(cfg: ModelConfig, image_mask, lengths, seed=1):
    """A batch of random model inputs: images, their mask, prompt tokens and their mask."""
    g = torch.Generator().manual_seed(seed)
    b, s, size, n = len(lengths), len(cfg.image_slots), cfg.vision.image_size, cfg.max_token_len
    images = torch.rand(b, s, 3, size, size, generator=g) * 2 - 1
    tokens = torch.randint(2, cfg.vocab, (b, n), generator=g)
    token_mask = torch.arange(n)[None] < torch.tensor(lengths)[:, None]
    tokens[~token_mask] = 0
    return images, torch.tensor(image_mask, dtype=torch.bool), tokens, token_mask


# A batch of three with different cameras present and prompt lengths.
MASKS = [[1, 1, 1], [1, 0, 1], [0, 1, 0]]
LENGTHS = [24, 10, 3]


def asking_engine(model, tokenizer, **kw):
    """An engine on `model` with ~/ask's logic (Asks) active on it: two rows, five tokens."""
    cfg = dict(model='tiny', decode_k=1, max_requests=2, max_new_tokens=5, stop_at_eos=False,
               prompt_format='subtask', admission='reject_newest', max_question_tokens=48,
               compile=False)
    cfg.update(kw)
    engine = Engine(EngineConfig(**cfg), model=model, tokenizer=tokenizer)
    asks = Asks()
    asks.activate(engine)
    return engine, asks
