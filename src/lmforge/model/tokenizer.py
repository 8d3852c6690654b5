"""Tokenizers: a char-level tokenizer for synthetic tasks, byte-level BPE training, chat templates.

Every tokenizer built here is a ``transformers.PreTrainedTokenizerFast`` that round-trips through
``save_pretrained`` / ``AutoTokenizer.from_pretrained`` and carries :data:`DEFAULT_CHAT_TEMPLATE`.

Special tokens: ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2 in both tokenizers, plus the role markers of
the default chat template (``<|system|>``, ``<|user|>``, ``<|assistant|>``) as single special tokens.
No bos is added automatically: callers add what they need.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..core.errors import ConfigError, DataError, ModelLoadError
from ..core.fileio import read_text

# Characters a char-level model sees on the built-in char-level tasks, plus room for simple extensions
# (``-``, ``*``, space) and the newline the default chat template uses. ``load_tokenizer("char")``
# builds its vocabulary from this string.
DEFAULT_ALPHABET = "0123456789+-*= \n"
# Printable ASCII and the newline: for char-level models that read and write more than digits, e.g.
# the built-in tool-use environments' tool calls (JSON) and messages. ``load_tokenizer("char:ascii")``.
ASCII_ALPHABET = "".join(map(chr, range(32, 127))) + "\n"  # (with TOOLS_CHAT_TEMPLATE, below)
CHAR_ALPHABETS = {"char": DEFAULT_ALPHABET, "char:ascii": ASCII_ALPHABET}  # char-level tokenizer specs
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")

# The chat template given to tokenizers that have none. Each message renders as
#     <|role|>\n{content}{eos_token}\n
# and ``add_generation_prompt=True`` appends ``<|assistant|>\n``. So a user/assistant pair is
#     <|user|>\n37+48=<eos>\n<|assistant|>\n58<eos>\n
# Every turn, the assistant's included, ends with the eos token: a model trained on this format stops
# generating after its answer. (The newline after eos is outside the assistant span; see data/sft.py.)
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# The default template that also renders ``tools`` (OpenAI schemas), as one short system turn listing each
# tool with its parameters, e.g. ``<|system|>\ncalculator(expression)<eos>\n``: the tool format of the
# ``char:ascii`` tokenizer, which a tiny model learns from demonstrations rather than reads (the default
# tool format of lmforge.envs.toolcalls, a JSON system block of some 600 characters, is for models that read).
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|system|>\n' }}{% for tool in tools %}{% set fn = tool.get('function', tool) %}"
    "{{ fn['name'] + '(' + (fn.get('parameters', {}).get('properties', {}) | join(', ')) + ')' }}"
    "{% if not loop.last %}{{ ' ' }}{% endif %}{% endfor %}{{ eos_token + '\n' }}{% endif %}" + DEFAULT_CHAT_TEMPLATE
)


def _wrap(backend, **special_tokens):  # backend: tokenizers.Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **special_tokens)
    tok.chat_template = DEFAULT_CHAT_TEMPLATE
    return tok


def char_tokenizer(alphabet: str = DEFAULT_ALPHABET):
    """One token per character of ``alphabet``; ``decode`` returns exactly the characters encoded.

    Ids: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3 (any character outside the alphabet, so that
    unknown text is visible rather than silently dropped), then the alphabet in the order given, then
    the chat role tokens. ``"\\n"`` is added to the alphabet if missing, since the default chat
    template uses it.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models

    if not alphabet:
        raise ValueError("char_tokenizer: the alphabet is empty")
    if len(set(alphabet)) != len(alphabet):
        duplicates = sorted({c for c in alphabet if alphabet.count(c) > 1})
        raise ValueError(f"char_tokenizer: alphabet has repeated characters {duplicates!r}")
    if "\n" not in alphabet:
        alphabet += "\n"
    vocab = {token: i for i, token in enumerate((PAD, BOS, EOS, UNK, *alphabet, *ROLE_TOKENS))}
    # BPE with no merges splits text into single characters; Fuse joins them back without spaces.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (PAD, BOS, EOS, UNK, *ROLE_TOKENS)]
    )
    backend.decoder = decoders.Fuse()
    return _wrap(backend, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK)


def train_bpe_tokenizer(files: list[Path], vocab_size: int, out_dir: Path | None = None, min_frequency: int = 2):
    """Train a byte-level BPE tokenizer on text files; save it as an HF tokenizer dir if ``out_dir``.

    Ids: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, the role tokens 3-5, the 256 byte symbols, then merges
    up to ``vocab_size``. Byte-level means any text encodes without unknown tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = [PAD, BOS, EOS, *ROLE_TOKENS]
    min_vocab = 256 + len(specials)
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size must be >= {min_vocab} (256 bytes + {len(specials)} specials), got {vocab_size}")
    paths = [Path(f) for f in files]
    if not paths:
        raise DataError("train_bpe_tokenizer: no text files given")
    for path in paths:
        if not path.is_file():
            raise DataError(f"{path}: tokenizer training file not found")
    if not any(read_text(path, "tokenizer training file").strip() for path in paths):
        raise DataError(f"tokenizer training files contain no text: {', '.join(map(str, paths))}")

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train([str(p) for p in paths], trainer)
    tok = _wrap(backend, pad_token=PAD, bos_token=BOS, eos_token=EOS)
    if out_dir is not None:
        tok.save_pretrained(str(out_dir))
    return tok


def ensure_chat_template(tok):
    """Give ``tok`` :data:`DEFAULT_CHAT_TEMPLATE` if it has no chat template; returns ``tok``.

    Modifies ``tok`` in place. A tokenizer that already has a template keeps it. The default
    template needs an eos token, so a tokenizer without one is an error.
    """
    if getattr(tok, "chat_template", None):
        return tok
    if tok.eos_token is None:
        raise ValueError("tokenizer has no chat template and no eos token; set tokenizer.eos_token first")
    tok.chat_template = DEFAULT_CHAT_TEMPLATE
    return tok


def load_tokenizer(spec: str):
    """``"char"`` -> :func:`char_tokenizer` over the default task alphabet, ``"char:ascii"`` over printable
    ASCII (:data:`CHAR_ALPHABETS`); a directory -> AutoTokenizer.

    Hub ids and GGUF files are resolved by the model loader, not here.
    """
    if spec in CHAR_ALPHABETS:
        tokenizer = char_tokenizer(CHAR_ALPHABETS[spec])
        if spec == "char:ascii":
            tokenizer.chat_template = TOOLS_CHAT_TEMPLATE
        return tokenizer
    path = Path(spec).expanduser()
    if path.is_dir():
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(path))
        except Exception as exc:  # a bad file in the directory: json, tokenizers and transformers errors
            raise ModelLoadError(
                f"{path}: cannot load a tokenizer from this directory ({type(exc).__name__}: "
                f"{exc}); expected a directory written by save_pretrained (tokenizer.json, "
                "tokenizer_config.json)"
            ) from exc
    raise ConfigError(
        f"tokenizer spec {spec!r} is neither 'char' nor an existing directory; accepted: 'char' "
        "(character-level, synthetic tasks), 'char:ascii' (character-level over printable ASCII: tool calls, "
        "messages) or a directory saved with save_pretrained "
        "(hub ids and GGUF files are loaded together with the model)"
    )


def tokenizer_fingerprint(tok) -> str:
    """A hash of everything that decides how ``tok`` turns text into ids (for data caches)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        state = backend.to_str()
    else:  # a slow tokenizer: its vocabulary and added tokens are the best available summary
        state = json.dumps(sorted(tok.get_vocab().items())) + type(tok).__name__
    return hashlib.sha256(f"{state}|eos={tok.eos_token_id}".encode("utf-8")).hexdigest()


# ----------------------------------------------------------------------------- unknown tokens

# Shares of the sampled data's tokens that are the tokenizer's unknown token: above the first a run
# stops at start (nothing is learnt from <unk>; the tokenizer does not fit the data), above the
# second it warns with the share. Not settings: a run that needs more than 5% unknown tokens is
# better served by a tokenizer that covers its text (a byte-level BPE has none).
UNKNOWN_ERROR_SHARE = 0.05
UNKNOWN_WARN_SHARE = 0.001
SAMPLE_TEXTS = 1000  # texts (rows, documents) tokenized for the check, spread evenly over the data
SAMPLE_CHARS = 20_000  # of each text at most


@dataclass
class UnknownTokens:
    """What a tokenizer could not represent in a sample of texts."""

    num_unknown: int = 0
    num_tokens: int = 0
    num_texts: int = 0
    pieces: Counter = field(default_factory=Counter)  # text that became the unknown token -> count
    example: str = ""  # the word around the first unknown piece

    @property
    def share(self) -> float:
        return self.num_unknown / self.num_tokens if self.num_tokens else 0.0


def sample_texts(texts: list[str], num: int = SAMPLE_TEXTS) -> list[str]:
    """At most ``num`` of ``texts``, evenly spaced (so the check sees the whole data, not its start),
    each cut to its first :data:`SAMPLE_CHARS` characters."""
    step = max(len(texts) / num, 1.0)
    return [texts[int(i * step)][:SAMPLE_CHARS] for i in range(min(num, len(texts)))]


def _word_at(text: str, start: int, end: int) -> str:
    """The whitespace-delimited word of ``text`` around ``text[start:end]`` (at most 40 characters)."""
    lo, hi = start, end
    while lo > 0 and not text[lo - 1].isspace() and start - lo < 20:
        lo -= 1
    while hi < len(text) and not text[hi].isspace() and hi - end < 20:
        hi += 1
    return text[lo:hi]


def count_unknown(tok, texts: list[str]) -> UnknownTokens:
    """The unknown tokens of ``tok`` in ``texts`` (encoded without special tokens). A tokenizer with
    no unknown token (byte-level BPE, byte fallback) has none by construction."""
    found = UnknownTokens(num_texts=len(texts))
    unk = getattr(tok, "unk_token_id", None)
    if not texts:
        return found
    fast = bool(getattr(tok, "is_fast", False))
    enc = tok(texts, add_special_tokens=False, return_offsets_mapping=fast, verbose=False)
    for i, ids in enumerate(enc["input_ids"]):
        found.num_tokens += len(ids)
        if unk is None:
            continue
        for j, token in enumerate(ids):
            if token != unk:
                continue
            found.num_unknown += 1
            if fast:
                start, end = enc["offset_mapping"][i][j]
                found.pieces[texts[i][start:end]] += 1
                found.example = found.example or _word_at(texts[i], start, end)
    if found.num_unknown and not fast:  # a slow tokenizer has no offsets: the words that encode to <unk>
        for word in (w for text in texts for w in text.split()):
            if unk in tok(word, add_special_tokens=False)["input_ids"]:
                found.pieces[word] += 1
                found.example = found.example or word
            if sum(found.pieces.values()) >= 50:
                break
    return found


def tokenizer_label(model_cfg) -> str:
    """How the run chose its tokenizer, as a user would change it (``model_cfg``: a ModelConfig)."""
    if model_cfg.tokenizer:
        return f"model.tokenizer={model_cfg.tokenizer}"
    if model_cfg.name.startswith("tiny:"):
        return f"the char tokenizer (model.name={model_cfg.name} uses it unless model.tokenizer is set)"
    return f"the tokenizer of model.name={model_cfg.name}"


def _unknown_fix(model_cfg, source: str) -> str:
    spec = model_cfg.tokenizer or ("char" if model_cfg.name.startswith("tiny:") else "")
    text_file = Path(source).suffix.lower() in (".txt", ".jsonl", ".json", ".ndjson") and Path(source).is_file()
    local = source if text_file else "your_text.txt"  # a file the BPE trainer reads as text
    bpe = (
        f'a byte-level BPE trained on the text (it has no unknown tokens): python -c "from lmforge.model.tokenizer '
        f"import train_bpe_tokenizer; train_bpe_tokenizer(['{local}'], 2048, 'my_tokenizer')\", then "
        "model.tokenizer=my_tokenizer (lmforge pretrain tokenizer.train=true also trains one on .txt files)"
    )
    pretrained = "or fine-tune a pretrained model with its own tokenizer (e.g. model.name=smollm2-135m-instruct)"
    if spec == "char":
        return (
            f"the char tokenizer knows only the characters {CHAR_ALPHABETS['char']!r} of the built-in tasks. "
            f"For English text set model.tokenizer=char:ascii (every printable ASCII character); for any text, "
            f"{bpe}; {pretrained}"
        )
    if spec in CHAR_ALPHABETS:
        return f"{spec} knows only printable ASCII and the newline; for other text, {bpe}; {pretrained}"
    return f"use a tokenizer that covers this text, e.g. {bpe}; or clean the data of what it cannot represent"


def check_unknown_tokens(
    tok, texts: list[str], model_cfg, source: str, say: Callable[[str], None] = print
) -> UnknownTokens:
    """Measure the unknown tokens of ``tok`` in a sample of ``texts`` (the training data's text) and
    stop above :data:`UNKNOWN_ERROR_SHARE` (ConfigError), or warn through ``say`` above
    :data:`UNKNOWN_WARN_SHARE`. Both name the tokenizer (``model_cfg``: the run's ModelConfig), the
    share, what became unknown and the fix; ``source`` names the data."""
    found = count_unknown(tok, sample_texts(texts))
    if found.share <= UNKNOWN_WARN_SHARE:
        return found
    common = ", ".join(f"{piece!r} x{n}" for piece, n in found.pieces.most_common(5))
    what = (
        f"{tokenizer_label(model_cfg)} turns {100 * found.share:.1f}% of the tokens of {source} into its "
        f"unknown token {getattr(tok, 'unk_token', '<unk>')} ({found.num_unknown:,} of {found.num_tokens:,} "
        f"tokens in {found.num_texts:,} sampled texts; e.g. {found.example!r}; most frequent: {common})"
    )
    if found.share > UNKNOWN_ERROR_SHARE:
        raise ConfigError(
            f"{what}: the model would learn nothing from that text. Fix: {_unknown_fix(model_cfg, source)}"
        )
    say(
        f"[data] warning: {what}; above {100 * UNKNOWN_ERROR_SHARE:g}% this stops the run. To avoid it: "
        f"{_unknown_fix(model_cfg, source)}"
    )
    return found
