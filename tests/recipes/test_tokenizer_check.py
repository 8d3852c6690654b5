"""The tokenizer check at start (issue 22): a tokenizer that turns the training text into <unk> stops the
run (exit 2) naming the tokenizer, the share, what became unknown and the fix; a small share is a
warning; a tokenizer that covers the text says nothing. Before, `model.tokenizer=char` on English chat
trained on <unk> without a word."""

import json
import re

import pytest

from lmforge.cli import EXIT_USER_ERROR, main
from lmforge.core.config import ModelConfig
from lmforge.core.errors import ConfigError
from lmforge.data.sft import CHAT_SMALL
from lmforge.model.tokenizer import char_tokenizer, check_unknown_tokens, count_unknown, train_bpe_tokenizer

TINY = [
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.max_position_embeddings=128",
    "train.max_steps=1",
    "train.threads=1",
    "train.eval_every=0",
    "train.save_every=0",
    "train.num_samples=0",
    "logging.progress=false",
]
SFT = TINY + ["train.batch_size=4", "data.max_len=96"]
RL = TINY + [
    "rollout.num_prompts=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=2",
    "rewards.functions=[format]",
    "data.num_eval=0",
]


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    english = [f"What is {i} plus {i}? Answer with a number." for i in range(40)]
    write_rows(root / "prompts.jsonl", [{"prompt": text, "answer": str(2 * i)} for i, text in enumerate(english)])
    (root / "english.txt").write_text(" ".join(english) * 4)
    # 1 unknown character in about 500 tokens: 0.2%, a warning
    write_rows(
        root / "few.jsonl",
        [{"prompt": f"{i}+{i}=", "completion": str(2 * i) + ("x" if i == 0 else "")} for i in range(100)],
    )
    train_bpe_tokenizer([CHAT_SMALL], 400, root / "bpe")
    return root


# (recipe, overrides) -> exit code, fragments of the output (stderr for errors, stdout for warnings)
CASES = {
    "sft, char tokenizer on English chat": (
        ["sft", "data.path=builtin:chat_small", "model.tokenizer=char"],
        EXIT_USER_ERROR,
        [
            r"model.tokenizer=char turns 7\d\.\d% of the tokens of builtin:chat_small into its unknown token <unk>",
            r"most frequent: 'e' x\d+",
            r"For English text set model.tokenizer=char:ascii",
            r"train_bpe_tokenizer",
            r"model.name=smollm2-135m-instruct",
        ],
    ),
    "grpo, the tiny model's implicit char tokenizer on English prompts": (
        ["grpo", "data.path={root}/prompts.jsonl"] + RL,
        EXIT_USER_ERROR,
        [
            r"the char tokenizer \(model.name=tiny:llama uses it unless model.tokenizer is set\) turns \d+\.\d% of "
            r"the tokens of .*prompts.jsonl",
            r"e.g. 'What'",
        ],
    ),
    "pretrain, char tokenizer on English text": (
        ["pretrain", "data.files=[{root}/english.txt]", "model.tokenizer=char", "data.seq_len=16"],
        EXIT_USER_ERROR,
        [r"turns \d+\.\d% of the tokens of data.files into its unknown token"],
    ),
    "sft, a few unknown characters: a warning": (
        ["sft", "data.path={root}/few.jsonl", "model.tokenizer=char"],
        0,
        [
            r"\[data\] warning: model.tokenizer=char turns 0\.\d% of the tokens of .*few.jsonl .*e.g. '0x'; most "
            r"frequent: 'x' x1\); above 5% this stops the run"
        ],
    ),
    "sft, char:ascii on English chat: silent": (
        ["sft", "data.path=builtin:chat_small", "model.tokenizer=char:ascii"],
        0,
        [],
    ),
    "sft, a BPE that covers the text: silent": (
        ["sft", "data.path=builtin:chat_small", "model.tokenizer={root}/bpe"],
        0,
        [],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_unknown_tokens_stop_or_warn_at_start(case, data, tmp_path, capsys):
    args, code, fragments = CASES[case]
    args = [a.format(root=data) for a in args] + (SFT if args[0] == "sft" else [])
    assert main(args + [f"train.output_dir={tmp_path / 'run'}"]) == code
    out = capsys.readouterr()
    text = out.err if code else out.out
    for fragment in fragments:
        assert re.search(fragment, text), (fragment, text[-3000:])
    if code == 0 and not fragments:
        assert "unknown token" not in out.out + out.err


@pytest.mark.parametrize(
    "texts, share, example",
    [
        (["12+34=46"], 0.0, ""),
        (["ab 12"], 2 / 5, "ab"),  # 'a' and 'b' are unknown; the example is the word around the first one
        (["1+1=2 Ünï"], 3 / 9, "Ünï"),
    ],
)
def test_count_unknown_counts_the_unknown_tokens_and_names_them(texts, share, example):
    found = count_unknown(char_tokenizer(), texts)
    assert found.share == share and found.example == example


def test_a_tokenizer_without_an_unknown_token_has_none(data):
    from transformers import AutoTokenizer

    bpe = AutoTokenizer.from_pretrained(str(data / "bpe"))
    found = count_unknown(bpe, ["Ünïcödé ✓ and anything else"])
    assert found.num_unknown == 0 and found.num_tokens > 0


def test_the_thresholds_are_exclusive_bounds():
    tok, cfg = char_tokenizer(), ModelConfig(tokenizer="char")
    said = []
    # 1 unknown token in 1000 = 0.1%: not above the warning bound
    check_unknown_tokens(tok, ["1" * 999 + "a"], cfg, "t", said.append)
    assert said == []
    check_unknown_tokens(tok, ["1" * 998 + "aa"], cfg, "t", said.append)
    assert len(said) == 1 and "0.2%" in said[0]
    check_unknown_tokens(tok, ["1" * 95 + "a" * 5], cfg, "t", said.append)  # exactly 5%: a warning
    with pytest.raises(ConfigError, match="6.0% of the tokens of t"):
        check_unknown_tokens(tok, ["1" * 94 + "a" * 6], cfg, "t", said.append)
