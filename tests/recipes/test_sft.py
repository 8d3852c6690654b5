"""SFT end to end on tiny models: chat rows from a file, and a synthetic task with accuracy."""
import json

from lmforge.config import load_config
from lmforge.data.sft import CHAT_SMALL
from lmforge.recipes.sft import SFTConfig, run_sft
from lmforge.tokenizer import train_bpe_tokenizer


def test_sft_on_shipped_chat_rows_with_trained_bpe(tmp_path, capsys):
    tok_dir = tmp_path / "tok"
    train_bpe_tokenizer([CHAT_SMALL], 400, tok_dir)
    out = tmp_path / "run"
    metrics = run_sft(load_config(SFTConfig, None, [
        "data.path=builtin:chat_small", f"model.tokenizer={tok_dir}", "model.hidden_size=32",
        "model.num_layers=2", "model.num_heads=2", "data.max_len=48", "train.max_steps=12",
        "train.micro_batch_size=8", "train.eval_every=6", "optim.lr=3e-3", "train.num_samples=2",
        "train.max_new_tokens=4", "logging.progress=false", f"train.output_dir={out}"]))
    printed = capsys.readouterr().out
    assert "rows truncated to 48 tokens" in printed  # some chat rows are longer: cut and counted
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all("<|assistant|>" in s["prompt"] for s in samples)
    assert metrics["val_loss"] > 0 and "accuracy" not in metrics


def test_sft_on_task_reports_accuracy(tmp_path):
    out = tmp_path / "run"
    metrics = run_sft(load_config(SFTConfig, None, [
        "data.task=addition", "data.num_train=256", "data.num_eval=16", "model.tokenizer=char",
        "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "data.max_len=16",
        "train.max_steps=4", "train.micro_batch_size=16", "train.max_new_tokens=4",
        "logging.progress=false", f"train.output_dir={out}"]))
    assert 0.0 <= metrics["accuracy"] <= 1.0
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    assert evals and "accuracy" in evals[-1] and "val_ppl" in evals[-1]
