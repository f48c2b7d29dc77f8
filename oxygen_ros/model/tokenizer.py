"""SentencePiece tokenizer with PaliGemma conventions, and the prompts pi0.5 is trained on.

The real PaliGemma model (paligemma_tokenizer.model, 257152 pieces) is loaded from a
user-given path. Without one, `Tokenizer.default()` trains a small stand-in model so a
random-weight demo still has text to show.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import sentencepiece as spm

PAD_ID = 0
EOS_ID = 1
BOS_ID = 2
UNK_ID = 3

# An id the SentencePiece model does not know (the model's embedding table may be larger
# than the tokenizer, and a random-weight model samples anywhere in it) decodes to this.
OUT_OF_VOCAB = "<{}>"


class Tokenizer:
    """Encodes text with BOS first, pads with PAD_ID; decodes any int id without raising."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer model not found: {path}")
        self._init(path.read_bytes(), source=str(path))

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "<bytes>") -> Tokenizer:
        self = cls.__new__(cls)
        self._init(bytes(data), source=source)
        return self

    @classmethod
    def default(cls) -> Tokenizer:
        """A small deterministic tokenizer trained on robot-task phrases, built once per process."""
        global _default_bytes
        with _default_lock:
            if _default_bytes is None:
                _default_bytes = _train_default()
        return cls.from_bytes(_default_bytes, source="<built-in>")

    def _init(self, data: bytes, source: str) -> None:
        self._sp = spm.SentencePieceProcessor(model_proto=data)
        self.source = source
        # A model trained with other special ids would silently break masks and stopping.
        if self._sp.pad_id() != PAD_ID or self._sp.eos_id() != EOS_ID:
            raise ValueError(
                f"{source}: expected pad id {PAD_ID} and eos id {EOS_ID} (PaliGemma), "
                f"got pad {self._sp.pad_id()} and eos {self._sp.eos_id()}"
            )
        self.bos_id = self._sp.bos_id()
        self._longest: int | None = None

    def model_proto(self) -> bytes:
        """The SentencePiece model, as a .model file holds it."""
        return self._sp.serialized_model_proto()

    @property
    def vocab_size(self) -> int:
        return self._sp.vocab_size()

    @property
    def eos_id(self) -> int:
        return EOS_ID

    @property
    def pad_id(self) -> int:
        return PAD_ID

    @property
    def longest_piece(self) -> int:
        """The most characters one token stands for (a byte piece such as <0xE2> counts its
        six): bounds how much text fits in n tokens without encoding it."""
        if self._longest is None:
            sp = self._sp
            self._longest = max(len(sp.id_to_piece(i)) for i in range(sp.vocab_size()))
        return self._longest

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return self._sp.encode(text, add_bos=bos)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`. Pad, BOS and EOS render as nothing; ids outside the vocabulary as
        OUT_OF_VOCAB, e.g. "<300000>" (the text after one starts like a fresh decode, so a
        leading space marker there is dropped)."""
        parts: list[str] = []
        run: list[int] = []
        size = self.vocab_size
        for i in ids:
            i = int(i)
            if 0 <= i < size:
                run.append(i)
                continue
            if run:
                parts.append(self._sp.decode(run))
                run = []
            parts.append(OUT_OF_VOCAB.format(i))
        if run:
            parts.append(self._sp.decode(run))
        return "".join(parts)

    def tokenize(self, text: str, max_len: int) -> tuple[np.ndarray, np.ndarray]:
        """BOS + text, truncated or right-padded to max_len; the mask marks real tokens."""
        ids = self.encode(text, bos=True)[:max_len]
        tokens = np.full(max_len, PAD_ID, dtype=np.int64)
        mask = np.zeros(max_len, dtype=np.bool_)
        tokens[: len(ids)] = ids
        mask[: len(ids)] = True
        return tokens, mask

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


def clean_task(task: str) -> str:
    return task.strip().replace("_", " ").replace("\n", " ")


def discretize_state(state: Sequence[float] | np.ndarray) -> np.ndarray:
    """256 bins over [-1, 1]; as in openpi, values below -1 give bin -1 and above 1 bin 255."""
    edges = np.linspace(-1.0, 1.0, 257)[:-1]
    return np.digitize(np.asarray(state, dtype=np.float64), bins=edges) - 1


def action_prompt(task: str, state: Sequence[float] | np.ndarray) -> str:
    """pi0.5's prefix text. `state` is already normalised and has the robot's own dims:
    openpi's robot transforms and LeRobot (>= 0.5) bin the state before any padding."""
    bins = " ".join(str(int(b)) for b in discretize_state(np.ravel(state)))
    return f"Task: {clean_task(task)}, State: {bins};\nAction: "


def subtask_prompt(task: str) -> str:
    return f"Task: {task.strip()}. Subtask: "


# A normalised value in each bin discretize_state gives: -1 (below -1), 0 .. 255.
BIN_VALUES = np.concatenate(([-2.0], np.linspace(-1.0, 1.0, 257)[:-1] + 1.0 / 256))
# With each digit a piece of its own, a bin's pieces depend only on its sign, first digit
# and length (the space marker may join the first digit): one bin of each kind stands for
# all, 22 tokenizations of a prompt instead of 257 (a live prompt is checked on the
# executor thread).
_KINDS = {}
for _x in BIN_VALUES:
    _b = str(int(discretize_state([_x])[0]))
    _KINDS.setdefault((_b[0], len(_b)), _x)
KIND_VALUES = np.array(list(_KINDS.values()))


def prompt_tokens(tokenizer: Tokenizer, task: str, state_dim: int,
                  prompt_format: str = "pi05") -> int:
    """The most tokens (BOS included) the model's prefix text of `task` can take: with
    "pi05", over every normalised state of `state_dim` dims (action_prompt); "subtask" has
    no state. Tokenize cuts at max_token_len, so past it the state is lost.

    The most over the states whose values all fall in one bin, which is the most over all
    states when each digit is a piece of its own (SentencePiece's split_digits; PaliGemma's
    tokenizer and the built-in one are so trained): a value's tokens are then its digits and
    what the space and sign before it become, whatever the other values are, so a state of
    three-digit bins (100 .. 255) takes the most.
    """
    if prompt_format == "subtask":
        return len(tokenizer.encode(subtask_prompt(task)))
    if prompt_format != "pi05":
        raise ValueError(f"unknown prompt format {prompt_format!r}")
    if state_dim < 1:
        raise ValueError(f"state_dim must be >= 1, got {state_dim}")
    return max(len(tokenizer.encode(action_prompt(task, np.full(state_dim, x))))
               for x in KIND_VALUES)


class StreamDecoder:
    """Turns token ids arriving one at a time into text deltas.

    SentencePiece text is not a per-token concatenation: the first piece loses its leading
    space marker and byte-fallback pieces only form a character together. So the whole id
    list is decoded each time and the unseen suffix is emitted, holding back a trailing
    U+FFFD that may still become a character. After `finish()`, the deltas concatenate to
    `tokenizer.decode(ids)`.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def feed(self, token: int) -> str:
        self.ids.append(int(token))
        full = self._tok.decode(self.ids)
        stable = full.rstrip("\ufffd")
        return self._advance(stable)

    def finish(self) -> str:
        return self._advance(self._tok.decode(self.ids))

    def _advance(self, full: str) -> str:
        # Text already emitted can not be taken back; wait until the decode agrees with it.
        if len(full) <= len(self.text) or not full.startswith(self.text):
            return ""
        delta = full[len(self.text) :]
        self.text = full
        return delta


_default_lock = threading.Lock()
_default_bytes: bytes | None = None

_OBJECTS = (
    "red cube, blue block, green cup, bowl, towel, shirt, plate, spoon, marker, pen, bottle, "
    "lid, drawer, box, sponge, apple, banana, tape, battery, cable, screwdriver, mug, fork, "
    "cloth, bag, tray"
).split(", ")
_VERBS = (
    "pick up the {}; place the {} in the bowl; put the {} on the plate; "
    "move the {} to the left; move the {} to the right; push the {} forward; open the {}; "
    "close the {}; fold the {}; hand over the {}; grasp the {}; lift the {}; rotate the {}; "
    "wipe the table with the {}; stack the {} on the box; insert the {} into the slot; "
    "pour from the {}; release the {}"
).split("; ")
_SUBTASKS = (
    "reach toward the object; align the gripper; close the gripper; open the gripper; "
    "lift the arm; lower the arm; move to the target; return to home position; "
    "transfer to the other hand; done"
).split("; ")


def _corpus() -> list[str]:
    lines: list[str] = []
    for i, verb in enumerate(_VERBS):
        for j, obj in enumerate(_OBJECTS):
            task = verb.format(obj)
            state = " ".join(str((7 * i + 13 * j + 31 * k) % 256) for k in range(8))
            lines.append(f"Task: {task}, State: {state};")
            subtask = _SUBTASKS[(i + j) % len(_SUBTASKS)]
            lines.append(f"Task: {task}. Subtask: {subtask}")
            lines.append(f"Action: {subtask}")
    return lines


def _train_default() -> bytes:
    # Gemma-like options: text kept as written, digits one per piece, "\n" a piece of its
    # own (the action prompt has one), and byte fallback so any text round-trips.
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()),
        model_writer=out,
        model_type="bpe",
        vocab_size=512,
        hard_vocab_limit=False,
        byte_fallback=True,
        character_coverage=1.0,
        split_digits=True,
        user_defined_symbols=["\n"],
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        pad_id=PAD_ID,
        eos_id=EOS_ID,
        bos_id=BOS_ID,
        unk_id=UNK_ID,
        num_threads=1,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    return out.getvalue()
