"""lm-eval against ``lmforge serve``: its ``local-completions`` model scores a ``multiple_choice`` and a
``loglikelihood_rolling`` task (local JSONL files) through completions' ``echo`` + ``logprobs``, and every
per-sample loglikelihood equals what lm-eval's own ``hf`` model computes on the same weights.

Slow layer (``-m slow``): lm-eval's import and two evaluations take ~30 s. The model is the tiny Llama with
the char tokenizer, saved with ``save_pretrained`` so that ``hf`` and the tokenizer lm-eval loads are the
served model's."""

from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.slow

MAX_LENGTH = 48  # both lm-eval models' window; the served context is 64 (room for lm-eval's max_tokens 1)
REL = 1e-4

QUESTIONS = [
    ("12+34=", ["46", "47", "56"], 0),
    ("7*8=", ["54", "56", "58"], 1),
    ("9-4=", ["3", "4", "5"], 2),
    ("2+2=", ["4", "22"], 0),
    ("10*10=", ["100", "1000", "10"], 0),
    ("5+5=", ["55", "10"], 1),
]
TEXTS = ["1+1=2 2+2=4 3+3=6", "12*3=36\n36-6=30", "9+9=18 " * 12]  # the last spans several rolling windows


def _task_files(root) -> None:
    with open(root / "sums.jsonl", "w") as f:
        for question, choices, label in QUESTIONS:
            f.write(json.dumps({"question": question, "choices": choices, "label": label}) + "\n")
    with open(root / "texts.jsonl", "w") as f:
        for text in TEXTS:
            f.write(json.dumps({"text": text}) + "\n")
    common = "dataset_path: json\ntest_split: test\nmetadata:\n  version: 1.0\n"
    (root / "sums_mc.yaml").write_text(
        f"task: lmforge_sums_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'sums.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_target: label\n"
        "doc_to_choice: '{{choices}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (root / "texts_rolling.yaml").write_text(
        f"task: lmforge_texts_rolling\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'texts.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
    )


def _evaluate(lm_eval, model: str, model_args: dict, task_dir) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        log_samples=True,
        tasks=["lmforge_sums_mc", "lmforge_texts_rolling"],
        task_manager=TaskManager(include_path=str(task_dir)),
    )


def _loglikelihoods(results: dict, task: str) -> dict[int, list[float]]:
    """doc id -> the loglikelihood of each of its requests (each choice; each text)."""
    return {
        s["doc_id"]: [r[0] if isinstance(r, (list, tuple)) else r for r in s["filtered_resps"]]
        for s in results["samples"][task]
    }


def test_local_completions_scores_equal_the_hf_models(serve_model, make_tiny, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    model, tokenizer = make_tiny()
    weights = tmp_path / "model"
    model.save_pretrained(weights)
    tokenizer.save_pretrained(weights)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _task_files(tasks)
    server = serve_model(model, tokenizer)

    served = _evaluate(
        lm_eval,
        "local-completions",
        {
            "model": "tiny-test",
            "base_url": server.url + "/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(weights),
            "max_length": MAX_LENGTH,
            "num_concurrent": 2,
            "max_retries": 1,
            "batch_size": 4,
            "tokenized_requests": True,
        },
        tasks,
    )
    local = _evaluate(
        lm_eval,
        "hf",
        {"pretrained": str(weights), "dtype": "float32", "device": "cpu", "max_length": MAX_LENGTH, "batch_size": 4},
        tasks,
    )

    for task, count in (("lmforge_sums_mc", len(QUESTIONS)), ("lmforge_texts_rolling", len(TEXTS))):
        got, want = _loglikelihoods(served, task), _loglikelihoods(local, task)
        assert sorted(got) == sorted(want) == list(range(count))
        for doc in want:
            assert len(got[doc]) == len(want[doc])
            for a, b in zip(got[doc], want[doc]):
                assert math.isclose(a, b, rel_tol=REL), (task, doc, got[doc], want[doc])
    got, want = served["results"]["lmforge_sums_mc"], local["results"]["lmforge_sums_mc"]
    assert got["acc,none"] == want["acc,none"] and got["acc_norm,none"] == want["acc_norm,none"]
    got, want = served["results"]["lmforge_texts_rolling"], local["results"]["lmforge_texts_rolling"]
    for metric in ("word_perplexity,none", "byte_perplexity,none"):  # exp(-loglikelihood / count): compare logs
        assert math.isclose(math.log(got[metric]), math.log(want[metric]), rel_tol=REL), (metric, got, want)
