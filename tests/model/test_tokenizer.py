"""Tokenizers: char-level ids and round trips, BPE training, chat templates, save/reload, specs."""

import pytest
from transformers import AutoTokenizer

from lmforge.core.errors import ConfigError, DataError
from lmforge.model.tokenizer import (
    DEFAULT_CHAT_TEMPLATE,
    char_tokenizer,
    ensure_chat_template,
    load_tokenizer,
    tokenizer_fingerprint,
    train_bpe_tokenizer,
)

CORPUS = (
    "The quick brown fox jumps over the lazy dog. 37+48=85. "
    "A small model learns to add numbers column by column. Ünïcödé ✓ text.\n"
) * 40


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpe")
    (root / "a.txt").write_text(CORPUS, encoding="utf-8")
    train_bpe_tokenizer([root / "a.txt"], vocab_size=320, out_dir=root / "tok")
    return root


# ----------------------------------------------------------------------------- char tokenizer


def test_char_tokenizer_ids():
    tok = char_tokenizer("0123456789+=\n")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert tok.unk_token_id == 3
    assert tok("0")["input_ids"] == [4]  # alphabet in order after the 4 specials, no bos added
    assert tok("37+48=")["input_ids"] == [7, 11, 14, 8, 12, 15]


def test_char_tokenizer_round_trip_without_spaces():
    tok = char_tokenizer("0123456789+-*= \n")
    text = "12+34=64\n 7 * 8=56"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_token_id]) == text + "<eos>"
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text


def test_char_tokenizer_marks_unknown_characters():
    tok = char_tokenizer("01")
    assert tok("0x1")["input_ids"] == [4, 3, 5]


def test_char_tokenizer_adds_newline_and_rejects_repeats():
    assert "\n" in char_tokenizer("01").get_vocab()
    with pytest.raises(ValueError, match=r"repeated characters \['1'\]"):
        char_tokenizer("0112")
    with pytest.raises(ValueError, match="empty"):
        char_tokenizer("")


def test_char_tokenizer_save_reload(tmp_path):
    tok = char_tokenizer("0123456789+=\n")
    tok.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "<|user|>\n12+34=<eos>\n<|assistant|>\n46<eos>\n"
    assert reloaded(text)["input_ids"] == tok(text)["input_ids"]
    assert reloaded.decode(tok(text)["input_ids"]) == text
    assert reloaded.chat_template == DEFAULT_CHAT_TEMPLATE
    assert (reloaded.pad_token_id, reloaded.bos_token_id, reloaded.eos_token_id) == (0, 1, 2)
    assert tokenizer_fingerprint(reloaded) == tokenizer_fingerprint(tok)


def test_default_chat_template_renders_documented_format():
    tok = char_tokenizer("0123456789+=")
    messages = [{"role": "user", "content": "37+48="}, {"role": "assistant", "content": "58"}]
    assert tok.apply_chat_template(messages, tokenize=False) == "<|user|>\n37+48=<eos>\n<|assistant|>\n58<eos>\n"
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|user|>\n37+48=<eos>\n<|assistant|>\n"
    ids = tok(prompt)["input_ids"]
    assert 3 not in ids  # every character of the template is in the vocabulary (no <unk>)
    assert ids[0] == tok.convert_tokens_to_ids("<|user|>")


# ----------------------------------------------------------------------------- BPE


def test_bpe_training_and_round_trip(bpe_dir):
    tok = AutoTokenizer.from_pretrained(bpe_dir / "tok")
    assert len(tok) <= 320
    assert [tok.convert_tokens_to_ids(t) for t in ("<pad>", "<bos>", "<eos>")] == [0, 1, 2]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "The lazy fox adds 12+30=42. Ünïcödé ✓ and unseen bytes: ß€"
    ids = tok(text)["input_ids"]
    assert ids[0] != tok.bos_token_id  # no bos added automatically
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode("utf-8"))  # merges were learned
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE


def test_bpe_reload_gives_identical_ids(bpe_dir):
    first = train_bpe_tokenizer([bpe_dir / "a.txt"], vocab_size=320)
    reloaded = AutoTokenizer.from_pretrained(bpe_dir / "tok")
    assert first(CORPUS[:500])["input_ids"] == reloaded(CORPUS[:500])["input_ids"]


def test_bpe_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"nope\.txt: tokenizer training file not found"):
        train_bpe_tokenizer([tmp_path / "nope.txt"], vocab_size=300)


def test_bpe_empty_files(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n", encoding="utf-8")
    with pytest.raises(DataError, match=r"no text: .*empty\.txt"):
        train_bpe_tokenizer([tmp_path / "empty.txt"], vocab_size=300)
    with pytest.raises(DataError, match="no text files"):
        train_bpe_tokenizer([], vocab_size=300)


def test_bpe_vocab_too_small(tmp_path):
    with pytest.raises(ValueError, match="vocab_size must be >= 262"):
        train_bpe_tokenizer([tmp_path / "a.txt"], vocab_size=100)


# ----------------------------------------------------------------------------- templates and specs


def test_ensure_chat_template_sets_only_when_missing():
    tok = char_tokenizer("01")
    tok.chat_template = None
    assert ensure_chat_template(tok) is tok
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE
    tok.chat_template = "{{ messages[0]['content'] }}"
    ensure_chat_template(tok)
    assert tok.chat_template == "{{ messages[0]['content'] }}"


def test_load_tokenizer_specs(bpe_dir):
    char = load_tokenizer("char")
    assert char.decode(char("12+3=15\n")["input_ids"]) == "12+3=15\n"
    ascii_char = load_tokenizer("char:ascii")  # tool calls and messages: every printable character
    text = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>\n'
    ids = ascii_char(text)["input_ids"]
    assert ascii_char.unk_token_id not in ids and ascii_char.decode(ids) == text
    assert char.unk_token_id in char(text)["input_ids"]
    assert len(load_tokenizer(str(bpe_dir / "tok"))) == len(AutoTokenizer.from_pretrained(bpe_dir / "tok"))


def test_load_tokenizer_bad_spec_says_what_is_accepted(tmp_path):
    with pytest.raises(ConfigError, match=r"'.*missing'.*accepted: 'char'.*directory"):
        load_tokenizer(str(tmp_path / "missing"))


def test_fingerprint_depends_on_vocabulary():
    assert tokenizer_fingerprint(char_tokenizer("01")) != tokenizer_fingerprint(char_tokenizer("012"))
    assert tokenizer_fingerprint(char_tokenizer("01")) == tokenizer_fingerprint(char_tokenizer("01"))
