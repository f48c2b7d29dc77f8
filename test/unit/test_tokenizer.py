import io

import numpy as np
import pytest
import sentencepiece as spm
from support.paths import FIXTURES  # noqa: E402

from oxygen_ros.model import tokenizer as tk
from oxygen_ros.model.tokenizer import (
    BIN_VALUES,
    StreamDecoder,
    Tokenizer,
    action_prompt,
    discretize_state,
    prompt_tokens,
    subtask_prompt,
)

CORPUS = [
    "pick up the red cube and put it in the bowl",
    "fold the towel in half",
    "open the top drawer",
    "Task: stack the blocks, State: 12 128 255;",
    "Task: wipe the table. Subtask: grasp the sponge",
    "Action: move the left arm",
    "hand the cup to the other arm",
    "close the lid of the box",
] * 4


def _train(**ids) -> bytes:
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=out,
        model_type="bpe",
        vocab_size=320,
        hard_vocab_limit=False,
        byte_fallback=True,
        character_coverage=1.0,
        # Like Gemma: no NFKC, whitespace and newlines kept as written.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        num_threads=1,
        minloglevel=2,
        **ids,
    )
    return out.getvalue()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("spm") / "tiny.model"
    path.write_bytes(_train(pad_id=0, eos_id=1, bos_id=2, unk_id=3))
    return path


@pytest.fixture(scope="module")
def tok(model_path):
    return Tokenizer(model_path)


def test_special_ids_and_bos(tok):
    assert tok.eos_id == 1
    assert tok.pad_id == 0
    ids = tok.encode("fold the towel")
    assert ids[0] == 2
    assert tok.encode("fold the towel", bos=False) == ids[1:]
    assert 300 <= tok.vocab_size <= 320


def test_round_trip_including_bytes(tok):
    for text in ["pick up the red cube", "Task: café, State: 0 5;\nAction: ", "grasp 🍵 now"]:
        assert tok.decode(tok.encode(text)) == text


def test_special_tokens_decode_to_nothing(tok):
    ids = tok.encode("open the drawer")
    assert tok.decode([*ids, 1, 0, 0]) == "open the drawer"


def test_out_of_vocab_ids_render_as_placeholder(tok):
    big = tok.vocab_size + 7
    ids = tok.encode("open", bos=False) + [big] + tok.encode("the", bos=False)
    assert tok.decode(ids) == f"open<{big}>the"
    assert tok.decode([-5]) == "<-5>"


def test_tokenize_pads_and_masks(tok):
    ids = tok.encode("open the drawer")
    tokens, mask = tok.tokenize("open the drawer", max_len=len(ids) + 3)
    assert tokens.dtype == np.int64 and mask.dtype == np.bool_
    assert tokens.tolist() == ids + [0, 0, 0]
    assert mask.tolist() == [True] * len(ids) + [False] * 3


def test_tokenize_truncates(tok):
    ids = tok.encode("pick up the red cube and put it in the bowl")
    tokens, mask = tok.tokenize("pick up the red cube and put it in the bowl", max_len=4)
    assert tokens.tolist() == ids[:4]
    assert mask.all()


def test_from_bytes_matches_path(tok, model_path):
    other = Tokenizer.from_bytes(model_path.read_bytes())
    assert other.encode("stack the blocks") == tok.encode("stack the blocks")


def test_missing_file_and_wrong_special_ids(tmp_path):
    with pytest.raises(FileNotFoundError):
        Tokenizer(tmp_path / "nope.model")
    # SentencePiece's own defaults (unk 0, bos 1, eos 2) would break masks and stopping.
    with pytest.raises(ValueError, match="eos id 1"):
        Tokenizer.from_bytes(_train())


def test_discretize_state_by_hand():
    # bin = floor((x + 1) * 128); below -1 gives -1, 1 and above give 255 (openpi's digitize).
    assert discretize_state([-1, 0, 0.999, 1]).tolist() == [0, 128, 255, 255]
    assert discretize_state([-1.5, 2.0]).tolist() == [-1, 255]
    assert discretize_state([-0.9921875, -0.9921876]).tolist() == [1, 0]
    assert discretize_state([0.99, 0.5, -0.5]).tolist() == [254, 192, 64]


def test_action_prompt_format():
    text = action_prompt("  pick_up the\nmug  ", np.array([-1, 0, 0.999, 1]))
    assert text == "Task: pick up the mug, State: 0 128 255 255;\nAction: "
    # Cleaning strips first, then replaces, so a trailing "_" leaves a space.
    assert action_prompt("fold_towel_", [0.5]) == "Task: fold towel , State: 192;\nAction: "


def test_subtask_prompt_format():
    assert subtask_prompt("fold the towel") == "Task: fold the towel. Subtask: "
    # As the node stores a prompt: stripped.
    assert subtask_prompt(" fold the towel\n") == "Task: fold the towel. Subtask: "


TOKENIZERS = {"built-in": Tokenizer.default,
              "openpi fixture": lambda: Tokenizer(FIXTURES / "openpi_pi05" / "tokenizer.model"),
              "lerobot fixture": lambda: Tokenizer(FIXTURES / "lerobot_pi05" / "tokenizer.model")}


def test_bin_values_cover_every_bin():
    assert discretize_state(BIN_VALUES).tolist() == list(range(-1, 256))


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("task", ["wave", "stack_3 cups, then 12"])
def test_prompt_tokens_is_the_most_any_state_takes(name, task):
    tok = TOKENIZERS[name]()

    def count(state):
        return len(tok.encode(action_prompt(task, state)))

    def most(bins):
        # action_prompt's text (test_action_prompt_format) of states given by their bins
        task_text = task.strip().replace("_", " ").replace("\n", " ")
        texts = [f"Task: {task_text}, State: {' '.join(map(str, b))};\nAction: " for b in bins]
        return max(len(ids) for ids in tok._sp.encode(texts, add_bos=True))

    # Every 2-d state, bin by bin: the most is what prompt_tokens says.
    every = range(-1, 256)
    assert most([(a, b) for a in every for b in every]) == prompt_tokens(tok, task, 2)
    # 7-d: random states never take more, and one with every value at 1 takes as many.
    worst = prompt_tokens(tok, task, 7)
    rng = np.random.default_rng(0)
    assert most(rng.integers(-1, 256, size=(3000, 7))) <= worst == count(np.ones(7))
    assert count(np.full(7, -0.99)) < worst  # bin 1 takes fewer: not vacuous
    assert prompt_tokens(tok, task, 7, "subtask") == len(tok.encode(subtask_prompt(task)))


def _stream(tok, ids):
    dec = StreamDecoder(tok)
    deltas = [dec.feed(i) for i in ids]
    deltas.append(dec.finish())
    return deltas


def test_stream_concatenates_to_decode(tok):
    ids = tok.encode("Task: grasp the café cup 🍵, State: 3 4;\nAction: open", bos=False)
    deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert deltas[0] == "T"  # the leading space marker of the first piece is dropped
    assert not any("\ufffd" in d for d in deltas)  # partial UTF-8 is held back
    assert "🍵" in deltas


def test_stream_random_ids(tok):
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = rng.integers(0, tok.vocab_size + 20, size=rng.integers(1, 25)).tolist()
        assert "".join(_stream(tok, ids)) == tok.decode(ids)


def test_stream_finish_flushes_invalid_bytes(tok):
    lone = tok._sp.piece_to_id("<0xC3>")
    deltas = _stream(tok, [lone])
    assert deltas == ["", "\ufffd"]


def test_default_is_deterministic_and_paligemma_shaped():
    a = Tokenizer.default()
    b = Tokenizer.default()
    assert tk._default_bytes is not None
    assert tk._train_default() == tk._default_bytes
    assert 256 < a.vocab_size <= 1024
    assert (a._sp.pad_id(), a._sp.eos_id(), a._sp.bos_id(), a._sp.unk_id()) == (0, 1, 2, 3)
    text = action_prompt("pick up the red cube", [0.1, -0.2])
    assert a.encode(text) == b.encode(text)
    assert a.decode(a.encode(text)) == text
