"""On-policy distillation at a sampling temperature other than 1, with a teacher that differs from the
student (issue 37 item 7): the logged ``reverse_kl`` is the KL of the two models' softmax(logits / T)
on the step's own rows, recomputed here from scratch (each row alone, the whole vocabulary, fp64), for
both signals. At T = 1 (every other distillation test) a teacher scored without T cannot be told apart."""

import pytest
import torch
from run_records import records

from lmforge import rl
from lmforge.core.config import ModelConfig, load_config
from lmforge.model.load import load_model
from lmforge.recipes.distill import DistillConfig, run_distill

TEMPERATURE = 0.5
TINY = {"tokenizer": "char", "hidden_size": 32, "num_layers": 2, "num_heads": 2, "max_position_embeddings": 32}
ARGS = (
    [f"model.{k}={v}" for k, v in TINY.items()]
    + [f"teacher.{k}={v}" for k, v in TINY.items()]
    + [
        "teacher.name=tiny:llama",
        "teacher.init_seed=1",
        "teacher.dtype=fp32",
        "train.max_steps=1",
        "train.save_every=0",
        "train.eval_every=0",
        "train.max_new_tokens=4",
        "train.threads=1",
        "logging.progress=false",
        "data.task=addition",
        "data.num_train=64",
        "data.num_eval=8",
        "rollout.num_prompts=2",
        "rollout.group_size=4",
        "rollout.max_new_tokens=6",
        "train.micro_batch_size=4",
        f"rollout.temperature={TEMPERATURE}",
    ]
)


def row_logprobs(model, batch: rl.TrainBatch, row: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, V) log softmax(logits / T) in fp64 at the positions predicting row ``row``'s trained tokens, and
    those tokens (n,): the row alone, prompt then completion, no padding, no packing."""
    prompt_len = int(batch.prompt_lens[row])
    completion = batch.completion_ids[row]
    ids = batch.input_ids[row, : int(batch.attention_mask[row].sum())]
    assert torch.equal(ids[prompt_len:], completion[: len(ids) - prompt_len])  # the layout is prompt + completion
    trained = batch.trained_mask[row].bool()[: len(ids) - prompt_len].nonzero().squeeze(1)
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].double()
    return torch.log_softmax(logits[prompt_len + trained - 1] / temperature, -1), completion[trained]


def recomputed_kl(batch: rl.TrainBatch, temperature: float) -> dict[str, float]:
    """The sampled (k1: log q - log p of each sampled token) and exact reverse KL per trained token of
    the step's rows, student = the starting model (init seed 0), teacher = init seed 1."""
    student, _ = load_model(ModelConfig(name="tiny:llama", init_seed=0, **TINY))
    teacher, _ = load_model(ModelConfig(name="tiny:llama", init_seed=1, **TINY))
    sampled, full, count = 0.0, 0.0, 0
    for row in range(batch.num_rows):
        q, tokens = row_logprobs(student, batch, row, temperature)
        p, _ = row_logprobs(teacher, batch, row, temperature)
        picked = torch.arange(len(tokens))
        sampled += float((q[picked, tokens] - p[picked, tokens]).sum())
        full += float((q.exp() * (q - p)).sum())
        count += len(tokens)
    return {"sampled": sampled / count, "full": full / count}


@pytest.mark.parametrize("signal", ["sampled", "full"])
def test_the_logged_reverse_kl_is_that_of_both_models_at_the_sampling_temperature(tmp_path, monkeypatch, signal):
    packed = []
    real_pack = rl.pack_rollout
    monkeypatch.setattr(rl, "pack_rollout", lambda *a, **k: packed.append(real_pack(*a, **k)) or packed[-1])
    run_distill(load_config(DistillConfig, None, ARGS + [f"algo.signal={signal}", f"train.output_dir={tmp_path}"]))
    [batch] = packed  # the step's rows: 2 prompts x 4 samples, trained in 2 micro-batches
    assert batch.num_rows == 8 and int(batch.trained_mask.sum()) > 8
    logged = records(tmp_path)[1]["reverse_kl"]
    at_t = recomputed_kl(batch, TEMPERATURE)
    assert logged == pytest.approx(at_t[signal], rel=1e-4, abs=1e-6)
    # what a teacher (or student) scored at T = 1 would log instead: far enough off for the check above to see
    at_1 = recomputed_kl(batch, 1.0)
    assert abs(at_1[signal] - at_t[signal]) > 100 * max(1e-4 * abs(at_t[signal]), 1e-6), (at_1, at_t)
