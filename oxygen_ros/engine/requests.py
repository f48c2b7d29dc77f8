"""Language requests: what is in flight, one object per request (the paper's sigma)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

_ids = itertools.count(1)

# Why a request ended: end of sequence, its token budget, cancelled by its caller, dropped by
# the admission policy (for a newer request, or past the wait queue), refused a KV row.
REASONS = ('done', 'budget', 'cancelled', 'dropped', 'rejected')
ENDED_EARLY = ('cancelled', 'dropped', 'rejected')


@dataclass
class Request:
    """One language request, born from one frame's prefill and decoded across later frames.

    ``row`` is the KV cache row holding its prefix and generated tokens (None while it waits
    for a row); ``tokens`` are the generated ids. The first token comes from the prefill's last
    valid hidden state, so a request of T tokens needs T logits but only T-1 decode passes.

    ``extension`` holds the request's own tokens after the frame's shared prefix (a
    question); they are appended to its row in one pass before its first token is chosen.
    ``reason`` says why it ended: one of REASONS.
    """

    stamp: float
    prompt: str = ''
    max_new_tokens: int = 30
    stop_at_eos: bool = True
    temperature: float = 0.0
    seed: int = 0
    eos_id: int = 1
    kind: str = 'narration'  # or 'question'
    robot: str = ''  # whose frame started it; rows are counted against that robot's cap
    extension: list[int] = field(default_factory=list)
    id: int = field(default_factory=lambda: next(_ids))
    row: int | None = None
    tokens: list[int] = field(default_factory=list)
    frames: int = 0  # frames it has been decoded in so far
    finished: bool = False
    cancelled: bool = False
    reason: str = ''
    note: str = ''  # what happened, in words, when it ended early
    _generator: torch.Generator | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f'max_new_tokens must be at least 1, got {self.max_new_tokens}')
        if self.temperature < 0:
            raise ValueError(f'temperature must be >= 0, got {self.temperature}')

    @property
    def step(self) -> int:
        """Decode steps taken: one per generated token."""
        return len(self.tokens)

    @property
    def needs_pass(self) -> bool:
        """True when its last token must go through the model before the next can be sampled."""
        return bool(self.tokens) and not self.finished

    def append(self, token: int) -> None:
        self.tokens.append(token)
        if self.stop_at_eos and token == self.eos_id:
            self.end('done')
        elif len(self.tokens) >= self.max_new_tokens:
            self.end('budget')

    def end(self, reason: str) -> None:
        if reason not in REASONS:
            raise ValueError(f'reason must be one of {REASONS}, got {reason!r}')
        self.finished = True
        self.cancelled = reason in ENDED_EARLY
        self.reason = reason

    def generator(self, device: torch.device) -> torch.Generator:
        # One generator per request keeps sampled text independent of how requests are batched.
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed * 1_000_003 + self.id)
        return self._generator


def sample(logits: torch.Tensor, requests: list[Request],
           vocab_limit: int | None = None) -> list[int]:
    """One token per row of ``logits`` [b, vocab]: greedy where temperature is 0, else sampled.

    ``vocab_limit`` keeps ids the tokenizer cannot decode from being chosen (a tokenizer may be
    smaller than the model's vocabulary).
    """
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = logits[:, :vocab_limit]
    out = logits.argmax(dim=-1).tolist()
    for i, r in enumerate(requests):
        if r.temperature > 0:
            probs = torch.softmax(logits[i].float() / r.temperature, dim=-1)
            out[i] = int(torch.multinomial(probs, 1, generator=r.generator(logits.device)))
    return out
