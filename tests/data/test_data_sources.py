"""Every data source of docs/data.md (built in tmp_path), column mapping, held-out splits, streaming
packing, and the errors that name the source, row and column (issue 11, item 1)."""

import json

import pytest
import torch

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")

from lmforge.core.errors import DataError  # noqa: E402
from lmforge.data.prompts import held_out_split, load_prompt_rows  # noqa: E402
from lmforge.data.sft import load_sft_rows  # noqa: E402
from lmforge.data.source import read_text_column, source_kind, split_by_fraction  # noqa: E402
from lmforge.data.stream import StreamingBlocks, held_out, pack_stream  # noqa: E402
from lmforge.data.text import pack_documents  # noqa: E402
from lmforge.model.tokenizer import char_tokenizer  # noqa: E402
from lmforge.rl.config import RLDataConfig  # noqa: E402

QUESTIONS = {"question": ["1+1=", "2+2=", "3+4="], "answer": ["2", "4", "7"]}
EXPECTED = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}, {"prompt": "3+4=", "answer": "7"}]
MAP = {"prompt": "question"}


def _write(kind: str, tmp_path):
    """The QUESTIONS table as a source of ``kind``; returns the data.path to give."""
    ds = datasets.Dataset.from_dict(QUESTIONS)
    if kind == "save_to_disk":
        ds.save_to_disk(str(tmp_path / "saved"))
        return str(tmp_path / "saved")
    if kind == "parquet":
        ds.to_parquet(str(tmp_path / "q.parquet"))
        return str(tmp_path / "q.parquet")
    if kind == "csv":
        ds.to_csv(str(tmp_path / "q.csv"), index=False)
        return str(tmp_path / "q.csv")
    if kind == "tsv":
        (tmp_path / "q.tsv").write_text(
            "question\tanswer\n" + "".join(f"{q}\t{a}\n" for q, a in zip(QUESTIONS["question"], QUESTIONS["answer"]))
        )
        return str(tmp_path / "q.tsv")
    if kind == "arrow":
        table = pa.table(QUESTIONS)
        with pa.ipc.new_stream(str(tmp_path / "q.arrow"), table.schema) as writer:
            writer.write_table(table)
        return str(tmp_path / "q.arrow")
    if kind == "jsonl":
        (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ds.to_list()))
        return str(tmp_path / "q.jsonl")
    if kind == "json_array":
        (tmp_path / "q.json").write_text(json.dumps(ds.to_list()))
        return str(tmp_path / "q.json")
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["save_to_disk", "parquet", "csv", "tsv", "arrow", "jsonl", "json_array"])
def test_every_source_type_gives_the_same_rows_with_the_column_mapping(kind, tmp_path):
    path = _write(kind, tmp_path)
    assert load_prompt_rows(path, columns=MAP) == EXPECTED


def test_a_directory_of_split_files_and_a_saved_dataset_dict_have_named_splits(tmp_path):
    data_dir = tmp_path / "csvs"
    data_dir.mkdir()
    (data_dir / "train.csv").write_text("question,answer\n1+1=,2\n2+2=,4\n")
    (data_dir / "test.csv").write_text("question,answer\n3+4=,7\n")
    assert source_kind(str(data_dir)) == "dir"
    assert [r["prompt"] for r in load_prompt_rows(str(data_dir), "test", columns=MAP)] == ["3+4="]
    # CSV cells stay text: no "2" -> 2 (or "1.50" -> 1.5) that an exact-match reward would then miss
    assert [r["answer"] for r in load_prompt_rows(str(data_dir), "train", columns=MAP)] == ["2", "4"]
    (tmp_path / "decimals.csv").write_text("prompt,answer\nhalf of 3,1.50\nseven,007\n")
    assert [r["answer"] for r in load_prompt_rows(str(tmp_path / "decimals.csv"))] == ["1.50", "007"]
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict(QUESTIONS),
            "test": datasets.Dataset.from_dict({"question": ["9+9="], "answer": ["18"]}),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    assert load_prompt_rows(str(tmp_path / "dd"), "test", columns=MAP) == [{"prompt": "9+9=", "answer": "18"}]
    with pytest.raises(DataError, match=r"dd: no split 'validation'; it has test, train"):
        load_prompt_rows(str(tmp_path / "dd"), "validation", columns=MAP)


def test_sft_rows_from_csv_and_a_saved_dataset_with_mapped_columns(tmp_path):
    (tmp_path / "chat.csv").write_text('q,a\nHi,Hello!\n"Name, please",lmforge\n')
    expected = [{"prompt": "Hi", "completion": "Hello!"}, {"prompt": "Name, please", "completion": "lmforge"}]
    assert load_sft_rows(str(tmp_path / "chat.csv"), columns={"prompt": "q", "completion": "a"}) == expected
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    datasets.Dataset.from_dict({"conversation": [messages]}).save_to_disk(str(tmp_path / "chat"))
    assert load_sft_rows(str(tmp_path / "chat"), columns={"messages": "conversation"}) == [{"messages": messages}]


def _fake_hub_cache(root, repo: str, splits: dict):
    """What ``datasets.load_dataset(repo)`` leaves in a datasets cache, made offline from local Parquet."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    files = {}
    for split, table in splits.items():
        files[split] = str(root / f"{split}.parquet")
        datasets.Dataset.from_dict(table).to_parquet(files[split])
    name = repo.split("/")[-1]
    builder = Parquet(
        cache_dir=str(root / "cache"), dataset_name=name, data_files=files, hash="0123abcd", config_name="default"
    )
    builder.download_and_prepare()
    config_dir = next(p for p in (root / "cache" / name).iterdir() if p.is_dir())
    target = root / "cache" / repo.replace("/", "___") / "default"
    target.parent.mkdir(parents=True)
    config_dir.rename(target)


def test_a_hub_id_is_read_from_the_local_cache_with_the_hub_switched_off(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    _fake_hub_cache(
        tmp_path, "someone/tiny-math", {"train": QUESTIONS, "test": {"question": ["5+5="], "answer": ["10"]}}
    )
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    offline_before = datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE
    assert source_kind("someone/tiny-math") == "hub"
    assert load_prompt_rows("someone/tiny-math", "train", columns=MAP) == EXPECTED
    assert load_prompt_rows("someone/tiny-math", "test", columns=MAP) == [{"prompt": "5+5=", "answer": "10"}]
    assert (datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE) == offline_before  # restored


def test_a_hub_id_missing_from_the_cache_is_an_error_that_says_so_and_how_to_fill_it(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(DataError) as err:
        load_prompt_rows("nobody/not-cached")
    message = str(err.value)
    assert (
        "nobody/not-cached: not a local file or directory, and not in the local Hugging Face datasets cache" in message
    )
    assert "never downloads" in message and "datasets.load_dataset('nobody/not-cached')" in message


def test_missing_file_and_unsupported_type(tmp_path):
    with pytest.raises(DataError, match=r"nope\.csv: data file not found"):
        load_prompt_rows(str(tmp_path / "nope.csv"))
    (tmp_path / "q.xlsx").write_bytes(b"PK")
    with pytest.raises(DataError, match=r"q\.xlsx: unsupported file type '\.xlsx'"):
        load_prompt_rows(str(tmp_path / "q.xlsx"))


# ----------------------------------------------------------------------------- errors naming file, row and column


def test_a_mapped_column_the_table_lacks_names_the_file_the_column_and_what_it_has(tmp_path):
    path = _write("parquet", tmp_path)
    with pytest.raises(
        DataError,
        match=r"q\.parquet:row 1: no column 'problem' \(data\.columns maps 'prompt' to it\); "
        r"the row has answer, question",
    ):
        load_prompt_rows(path, columns={"prompt": "problem"})
    path = _write("csv", tmp_path)
    with pytest.raises(
        DataError,
        match=r"q\.csv: data\.columns maps 'prompt' to column 'problem', which the data does "
        r"not have \(columns: question, answer\)",
    ):
        load_prompt_rows(path, columns={"prompt": "problem"})


def test_a_missing_prompt_column_and_a_malformed_row_name_the_row_and_column(tmp_path):
    path = _write("arrow", tmp_path)
    with pytest.raises(DataError, match=r"q\.arrow:row 1: no 'prompt' column: each row needs a 'prompt' string"):
        load_prompt_rows(path)  # no mapping: the table has 'question', not 'prompt'
    (tmp_path / "bad.csv").write_text("prompt,answer\n1+1=,2\n,4\n")
    with pytest.raises(DataError, match=r"bad\.csv:row 2: no 'prompt' column"):
        load_prompt_rows(str(tmp_path / "bad.csv"))
    table = pa.table({"prompt": ["a", "b", "c"], "completion": ["x", "y", "z"]})
    with pa.ipc.new_stream(str(tmp_path / "sft.arrow"), table.schema) as writer:
        writer.write_table(table)
    assert len(load_sft_rows(str(tmp_path / "sft.arrow"))) == 3
    numbers = datasets.Dataset.from_dict({"prompt": ["a", "b"], "completion": [1, 2]})
    numbers.save_to_disk(str(tmp_path / "numbers"))
    with pytest.raises(DataError, match=r"numbers \(split 'train'\):row 1: 'completion' must be a string, got int"):
        load_sft_rows(str(tmp_path / "numbers"))


def test_an_empty_split_and_an_empty_file_are_errors_naming_them(tmp_path):
    data_dir = tmp_path / "dd"
    data_dir.mkdir()
    (data_dir / "train.csv").write_text("question,answer\n1+1=,2\n")
    (data_dir / "test.csv").write_text("question,answer\n")
    with pytest.raises(DataError, match=r"dd \(split 'test'\): no rows"):
        load_prompt_rows(str(data_dir), "test", columns=MAP)
    (tmp_path / "header.csv").write_text("question,answer\n")
    with pytest.raises(DataError, match=r"header\.csv: file has no rows"):
        load_prompt_rows(str(tmp_path / "header.csv"), columns=MAP)
    with pytest.raises(DataError, match=r"q\.csv: holds a single dataset \(split 'train'\), not split 'test'"):
        load_prompt_rows(_write("csv", tmp_path), "test", columns=MAP)


# ----------------------------------------------------------------------------- held-out split


def test_the_held_out_fraction_is_deterministic_in_the_seed_and_disjoint():
    items = list(range(100))
    kept, held = split_by_fraction(items, 0.1, seed=3)
    assert len(held) == 10 and sorted(kept + held) == items
    assert split_by_fraction(items, 0.1, seed=3) == (kept, held)
    assert split_by_fraction(items, 0.1, seed=4)[1] != held
    assert set(split_by_fraction(items, 0.2, seed=3)[1]) >= set(held)  # a larger fraction holds out a superset
    assert split_by_fraction([7], 0.5, seed=0) == ([7], [])


def test_held_out_prompt_rows_are_capped_by_num_eval_and_need_answers():
    data = RLDataConfig(path="p.parquet", eval_fraction=0.5, num_eval=3)
    train, held, note = held_out_split(data, 20, has_answers=True, seed=0)
    assert len(held) == 3 and len(train) == 17 and not set(train) & set(held)
    assert held == sorted(split_by_fraction(list(range(20)), 0.5, 0)[1][:3])
    assert "3 rows held out" in note
    train, held, note = held_out_split(data, 20, has_answers=False, seed=0)
    assert held == [] and len(train) == 20 and "no 'answer' column" in note


# ----------------------------------------------------------------------------- streaming

DOCS = [f"document {i}: " + "abc xyz " * (i % 5 + 1) for i in range(40)]


def test_the_streaming_packer_yields_the_tokens_of_the_in_memory_packer(tmp_path):
    tok = char_tokenizer()
    whole = pack_documents(DOCS, tok, seq_len=15, val_fraction=0.0).train
    for per_call in (1, 3, 64):
        streamed = torch.stack(list(pack_stream(iter(DOCS), tok, seq_len=15, docs_per_call=per_call)))
        assert torch.equal(streamed, whole)
    datasets.Dataset.from_dict({"content": DOCS}).to_parquet(str(tmp_path / "corpus.parquet"))
    docs = read_text_column(str(tmp_path / "corpus.parquet"), columns={"text": "content"}, streaming=True)
    assert not isinstance(docs, list)
    assert torch.equal(torch.stack(list(pack_stream(docs, tok, seq_len=15))), whole)


def test_streaming_blocks_wrap_around_and_resume_where_they_stopped():
    tok = char_tokenizer()
    whole = pack_documents(DOCS, tok, seq_len=15, val_fraction=0.0).train  # N blocks per pass
    blocks = StreamingBlocks(lambda: iter(DOCS), tok, seq_len=15, batch_rows=4)
    seen = [torch.stack([blocks[i] for i in blocks.next()]) for _ in range(len(whole) // 4 + 2)]
    flat = torch.cat(seen)
    assert torch.equal(flat[: len(whole) // 4 * 4], whole[: len(whole) // 4 * 4])
    assert blocks.epoch == 1 and torch.equal(seen[-1][-1], whole[blocks.pos - 1])
    # resume after 3 batches: the 4th batch is the same as without the interruption
    first = StreamingBlocks(lambda: iter(DOCS), tok, seq_len=15, batch_rows=4)
    for _ in range(3):
        first.next()
    resumed = StreamingBlocks(lambda: iter(DOCS), tok, seq_len=15, batch_rows=4)
    resumed.load_state_dict(first.state_dict())
    assert torch.equal(torch.stack([resumed[i] for i in resumed.next()]), seen[3])


def test_streaming_validation_documents_are_chosen_by_their_text():
    """The documented rule (data/stream.py, docs/data.md): a document is held out when the sha256 of
    its UTF-8 text, read as a fraction (first 8 bytes, big-endian, over 2**64), is below val_fraction.
    Recomputed here from the hex digest, so a different hash, byte order or comparison fails."""
    import hashlib

    def fraction(doc):
        return int(hashlib.sha256(doc.encode("utf-8")).hexdigest()[:16], 16) / 16**16

    docs = [f"document {i}: " + "abc xyz " * (i % 7 + 1) + ("é ü ✓" if i % 3 == 0 else "") for i in range(400)]
    for f in (0.0, 0.1, 0.25, 0.5, 1.0):
        assert [held_out(d, f) for d in docs] == [fraction(d) < f for d in docs], f
    # a uniform hash holds out Binomial(400, 0.25) documents: mean 100, sd sqrt(400 * .25 * .75) = 8.7;
    # 100 +- 35 is 4 sd, outside which a uniform hash falls with probability < 1e-4. A rule that used
    # val_fraction as a percentage, or held out the complement, lands near 1 or 300 and fails.
    chosen = [d for d in docs if held_out(d, 0.25)]
    assert 65 <= len(chosen) <= 135, len(chosen)
    assert not any(held_out(d, 0.0) for d in docs) and all(held_out(d, 1.0) for d in docs)


def test_a_stream_with_less_than_one_block_is_an_error():
    blocks = StreamingBlocks(lambda: iter(["ab"]), char_tokenizer(), seq_len=15, batch_rows=1)
    with pytest.raises(DataError, match="less than one block"):
        blocks.next()


def test_datasets_missing_gives_the_install_hint(tmp_path, monkeypatch):
    import sys

    path, jsonl = _write("csv", tmp_path), _write("jsonl", tmp_path)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(
        DataError,
        match=r"q\.csv: reading this source needs Hugging Face datasets: pip install "
        r"'lmforge\[data\]'",
    ):
        load_prompt_rows(path)
    # JSONL needs no datasets
    assert load_prompt_rows(jsonl, columns=MAP) == EXPECTED


@pytest.mark.real_plots
def test_held_out_eval_metrics_of_a_prompts_file_are_plotted(tmp_path):
    from lmforge.runtime.metrics import plot_run

    records = [{"kind": "eval", "step": s, "eval_reward": 0.1 * s, "pass_at_k": 0.2 * s} for s in range(3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert plot_run(tmp_path).stat().st_size > 1000  # a PNG with the two panels


def test_the_columns_setting_takes_a_mapping_and_rejects_anything_else():
    from lmforge.core.config import load_config
    from lmforge.core.errors import ConfigError
    from lmforge.recipes.grpo import GRPOConfig

    cfg = load_config(
        GRPOConfig, None, ["data.path=q.csv", "data.columns={prompt: question}", "data.columns.answer=sol"]
    )
    assert cfg.data.columns == {"prompt": "question", "answer": "sol"}
    with pytest.raises(ConfigError, match=r"config key 'data.columns': expected mapping of str to str"):
        load_config(GRPOConfig, None, ["data.path=q.csv", "data.columns=[question]"])
    with pytest.raises(ConfigError, match=r"data.eval_fraction must be in \[0, 1\)"):
        load_config(GRPOConfig, None, ["data.path=q.csv", "data.eval_fraction=1.5"])


def test_held_out_evaluator_scores_rows_with_the_first_reward_and_pass_at_k(monkeypatch):
    """accuracy = first reward at full marks on the greedy texts; eval_reward = weighted sum;
    pass_at_k = any of the k sampled texts at full marks (scripted completions, no model)."""
    from lmforge.rollout import BUILTIN_REWARDS, evaluation

    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": "6"}]
    greedy = ["2", "5", "6"]  # right, wrong, right
    sampled = ["9", "9", "4", "9", "9", "9"]  # k=2 per problem: none, right, none
    calls = []

    def scripted(model, tokenizer, prompts, max_new_tokens, batch_size=64, temperature=0.0, seed=0, lengths=None):
        calls.append((len(prompts), temperature, seed))
        texts = list(greedy if temperature == 0.0 else sampled)
        lengths.extend(len(text) + 1 for text in texts)  # + the stop token
        return texts

    monkeypatch.setattr(evaluation, "complete_ids", scripted)
    monkeypatch.setitem(BUILTIN_REWARDS, "half", lambda completion, problem: 0.5)
    evaluate = evaluation.held_out_evaluator(
        char_tokenizer(),
        rows,
        chat=False,
        max_new_tokens=4,
        reward_specs=[("exact", 1.0), ("half", 2.0)],
        pass_k=2,
        temperature=0.7,
        seed=5,
    )
    metrics, prompts, texts = evaluate(None, step=3)
    assert prompts == ["1+1=", "2+2=", "3+3="] and texts == greedy
    assert metrics["accuracy"] == pytest.approx(2 / 3)
    assert metrics["eval_reward"] == pytest.approx((2 * 1.0 + 3 * 2.0 * 0.5) / 3)  # exact + 2 x half
    assert metrics["pass_at_k"] == pytest.approx(1 / 3)
    assert calls == [(3, 0.0, 0), (6, 0.7, 8)]  # greedy, then k samples per problem seeded by seed + step


def test_held_out_evaluator_gives_the_rewards_the_completion_lengths(monkeypatch):
    """The overlong penalty needs each completion's length and rollout.max_new_tokens, in evaluation
    as in training: lengths 2 and 5 of max 5 with a cache of 2 score 0 and -1."""
    from lmforge.rollout import evaluation

    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]

    def scripted(model, tokenizer, prompts, max_new_tokens, batch_size=64, temperature=0.0, seed=0, lengths=None):
        lengths.extend([2, 5])
        return ["2", "4444"]

    monkeypatch.setattr(evaluation, "complete_ids", scripted)
    evaluate = evaluation.held_out_evaluator(
        char_tokenizer(),
        rows,
        chat=False,
        max_new_tokens=5,
        reward_specs=[("exact", 1.0), ("overlong", 1.0, {"cache": 2})],
        reward_kwargs={"max_new_tokens": 5},
    )
    metrics, _, _ = evaluate(None, step=0)
    assert metrics["accuracy"] == pytest.approx(1 / 2)
    assert metrics["eval_reward"] == pytest.approx(((1.0 + 0.0) + (0.0 - 1.0)) / 2)


def test_column_mapping_handles_swaps_and_shared_columns():
    from lmforge.data.source import rename_row

    row = {"prompt": "P", "answer": "A", "other": 1}
    assert rename_row(row, {"prompt": "answer", "answer": "prompt"}, "f:1") == {
        "prompt": "A",
        "answer": "P",
        "other": 1,
    }
    assert rename_row({"q": "Q"}, {"prompt": "q", "answer": "q"}, "f:1") == {"prompt": "Q", "answer": "Q"}
    assert rename_row(row, {"question": "prompt"}, "f:1") == {"answer": "A", "other": 1, "question": "P"}
