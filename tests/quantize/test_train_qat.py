"""train.qat and train.save_quantized in a real (tiny) SFT run through the one training loop."""

import copy
import json
import math

import pytest
import torch
from quant_helpers import HAS_CT, load_plain, needs_ct

from lmforge.core.config import load_config
from lmforge.core.errors import ConfigError
from lmforge.data.tasks import get_task
from lmforge.model.load import load_model
from lmforge.quantize import bake_qat, dequantize, quantize
from lmforge.quantize.qat import QATLinear
from lmforge.recipes.sft import SFTConfig, run_sft
from lmforge.rollout.evaluation import task_accuracy

ARGS = [
    "data.task=addition",
    "data.num_train=64",
    "data.num_val=16",
    "data.num_eval=16",
    "data.max_len=16",
    "model.tokenizer=char",
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.max_position_embeddings=32",
    "train.max_steps=6",
    "train.micro_batch_size=16",
    "train.batch_size=16",
    "train.save_every=0",
    "train.eval_every=3",
    "train.max_new_tokens=4",
    "train.threads=1",
    "optim.lr=1e-2",
    "logging.progress=false",
]
MAX_NEW = 4


def sft(out, *extra):
    cfg = load_config(SFTConfig, None, ARGS + [f"train.output_dir={out}", *extra])
    model, tokenizer = load_model(cfg.model)
    result = run_sft(cfg, model, tokenizer)
    return cfg, model, tokenizer, result


def held_out(cfg, model, tokenizer):
    """(accuracy, greedy completions) on the run's own held-out problems, as its evaluation computes them."""
    task = get_task(cfg.data.task)
    problems = task.make_problems(cfg.data.num_eval, cfg.train.seed, "test")
    return task_accuracy(model.eval(), tokenizer, task, problems, MAX_NEW, False)


def batch_logits(model, tokenizer):
    ids = torch.tensor([tokenizer.encode("12+34=46\n7+5=", add_special_tokens=False)])
    with torch.no_grad():
        return model.eval()(ids).logits[0]


def test_ternary_qat_sft_run_exports_exactly_what_it_trained(tmp_path):
    out = tmp_path / "run"
    cfg, model, tok, result = sft(out, "train.qat=ternary", "train.save_quantized=[ternary,ternary-5trit]")

    # master weights stay fp32 and are not ternary; the forward uses the ternarized weights
    linears = [m for m in model.modules() if isinstance(m, QATLinear)]
    assert len(linears) == 7 * 2 and {m.scheme for m in linears} == {"ternary"}
    up = model.get_submodule("model.layers.0.mlp.up_proj").weight
    assert up.dtype == torch.float32 and up.unique().numel() > 3
    qat_logits = batch_logits(model, tok)
    baked = copy.deepcopy(model)
    bake_qat(baked)
    assert up.unique().numel() > baked.get_submodule("model.layers.0.mlp.up_proj").weight.unique().numel() == 3
    torch.testing.assert_close(batch_logits(baked, tok), qat_logits, rtol=0, atol=1e-6)

    # every logged loss is finite and the final evaluation is the fake-quantized model's
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    accuracy, texts = held_out(cfg, model, tok)
    assert accuracy == result["accuracy"]

    # final/ holds the fp32 master weights, marked as QAT; plain transformers runs them unquantized
    assert json.loads((out / "final" / "config.json").read_text())["lmforge_qat"] == "ternary"
    master = load_plain(out / "final")
    assert (batch_logits(master, tok) - qat_logits).abs().max() > 1e-3

    # the export (the copy written by the run, and `lmforge quantize final --format ternary`) computes
    # the training forward: same logits up to fp32 rounding of the stored scale, same greedy completions
    quantize(str(out / "final"), "ternary", tmp_path / "exported")
    for packed in (
        out / "final" / "quantized-ternary",
        out / "final" / "quantized-ternary-5trit",
        tmp_path / "exported",
    ):
        hf = dequantize(packed, tmp_path / f"hf-{packed.name}")
        exported = load_plain(hf)
        torch.testing.assert_close(batch_logits(exported, tok), qat_logits, rtol=0, atol=1e-5)
        assert held_out(cfg, exported, tok) == (accuracy, texts)
    assert (out / "best" / "quantized-ternary" / "config.json").is_file()  # best/ got its copies too


def test_int4_qat_run_and_a_failed_quantized_copy_keeps_the_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    # GGUF needs a byte-level BPE tokenizer: the char tokenizer's copy fails; the int4-g32 one is written
    cfg, model, tok, result = sft(
        out, "train.qat=int4", "train.max_steps=2", "train.eval_every=0", "train.save_quantized=[q4_0,int4-g32]"
    )
    assert {m.scheme for m in model.modules() if isinstance(m, QATLinear)} == {"int4"}
    printed = capsys.readouterr().out
    assert "could not write the gguf-q4_0 copy" in printed and "the checkpoint itself is complete" in printed
    assert not any(p.name.startswith("quantized-gguf") for p in (out / "final").iterdir())
    if HAS_CT:  # int4 QAT's export keeps its grid: the copy computes the training forward
        exported = load_plain(out / "final" / "quantized-int4-g32")  # plain transformers + compressed-tensors
        torch.testing.assert_close(batch_logits(exported, tok), batch_logits(model, tok), rtol=0, atol=1e-5)
        assert held_out(cfg, exported, tok) == held_out(cfg, model, tok)
    final = load_plain(out / "final")  # the checkpoint is intact and loads
    assert json.loads((out / "final" / "config.json").read_text())["lmforge_qat"] == "int4"
    assert final.get_submodule("model.layers.0.mlp.up_proj").weight.dtype == torch.float32


def test_quantized_copies_are_inside_best_and_final_when_they_appear(tmp_path, monkeypatch):
    """The copies are written into the new best/ or final/ before it is renamed into place: a kill
    while they are written leaves the previous best/ whole, never a best/ without its copies."""
    from pathlib import Path

    from lmforge.runtime import loop

    calls, real = [], loop.write_quantized_copies

    def spy(model, tokenizer, directory, formats, printer=print, shown_as=None):
        directory = Path(directory)
        calls.append((directory, Path(shown_as), (directory / "model.safetensors").is_file()))
        return real(model, tokenizer, directory, formats, printer, shown_as)

    monkeypatch.setattr(loop, "write_quantized_copies", spy)
    out = tmp_path / "run"
    sft(out, "train.max_steps=2", "train.eval_every=1", "train.save_quantized=[ternary]")
    assert {shown.name for _, shown, _ in calls} == {"best", "final"}
    for directory, shown, has_model in calls:
        assert directory != shown and directory.parent == shown.parent  # a temporary sibling, renamed after
        assert has_model  # the model files first, then the copies
        assert not directory.exists()  # it became best/ or final/
    for name in ("best", "final"):
        assert (out / name / "quantized-ternary" / "config.json").is_file()


def test_bad_quant_settings_are_config_errors_before_training(tmp_path):
    with pytest.raises(ConfigError, match=r"train.qat.*one of 'none', 'ternary', 'int4'.*'int3'"):
        load_config(SFTConfig, None, ARGS + ["train.qat=int3"])
    cfg = load_config(SFTConfig, None, ARGS + [f"train.output_dir={tmp_path / 'r'}", "train.save_quantized=[int8,q3]"])
    with pytest.raises(ConfigError, match=r"train.save_quantized\[1\].*unknown format 'q3'.*valid formats: int8"):
        run_sft(cfg)
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
    # hidden 48: int4 groups of 32 do not divide the linear layers' input width
    cfg = load_config(
        SFTConfig, None, ARGS + [f"train.output_dir={tmp_path / 'g'}", "train.qat=int4", "model.hidden_size=48"]
    )
    with pytest.raises(ConfigError, match="train.qat=int4: .*group size 32 does not divide in_features 48"):
        run_sft(cfg)


def test_training_a_qat_checkpoint_without_qat_drops_the_marker(tmp_path):
    out = tmp_path / "qat"
    sft(out, "train.qat=ternary", "train.max_steps=1", "train.eval_every=0")
    cfg = load_config(
        SFTConfig,
        None,
        ARGS
        + [
            f"train.output_dir={tmp_path / 'plain'}",
            f"model.name={out / 'final'}",
            "model.tokenizer=",
            "train.max_steps=1",
            "train.eval_every=0",
        ],
    )
    model, tok = load_model(cfg.model)
    assert model.config.lmforge_qat == "ternary"
    run_sft(cfg, model, tok)
    assert not any(isinstance(m, QATLinear) for m in model.modules())
    assert "lmforge_qat" not in json.loads((tmp_path / "plain" / "final" / "config.json").read_text())


def test_qat_resume_reproduces_the_uninterrupted_run(tmp_path):
    """A QAT run resumed from its step-2 checkpoint logs the uninterrupted run's losses (QAT is
    re-applied before the optimizer state is loaded; the state-dict keys are unchanged)."""

    def losses(out):
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}

    # a constant LR: the schedule of a 2-step run would otherwise differ from a 4-step one
    common = [
        "train.qat=ternary",
        "train.eval_every=0",
        "train.save_every=2",
        "train.keep_last=5",
        "optim.schedule=constant",
    ]
    sft(tmp_path / "full", *common, "train.max_steps=4")
    sft(tmp_path / "part", *common, "train.max_steps=2")
    sft(tmp_path / "part", *common, "train.max_steps=4", "train.resume=auto")
    full, resumed = losses(tmp_path / "full"), losses(tmp_path / "part")
    assert sorted(full) == sorted(resumed) == [1, 2, 3, 4]
    assert all(full[s] == resumed[s] for s in full), (full, resumed)


def test_grpo_with_ternary_qat_samples_from_the_fake_quantized_model(tmp_path, monkeypatch):
    """With ``rollout.dtype=bf16`` the sampler is a separate bf16 copy of the policy (``CastEngine``).
    That copy computes with the fake-quantized (ternary) weights: its logits match the QAT policy's up
    to bf16 rounding and are far from those of the same weights used unquantized (the master weights),
    which is what a copy without QAT would compute."""
    from lmforge.recipes.grpo import GRPOConfig, run_grpo
    from lmforge.rl.sources import inprocess
    from lmforge.rollout.rewards import BUILTIN_REWARDS

    engines, calls = [], []

    def capture(*a, **k):  # the run's own cast_engine; keep the engine it builds and count its samples
        engine = real_cast_engine(*a, **k)
        real_generate = engine.generate
        engine.generate = lambda *ga, **gk: calls.append(1) or real_generate(*ga, **gk)
        engines.append(engine)
        return engine

    real_cast_engine = inprocess.cast_engine
    monkeypatch.setattr(inprocess, "cast_engine", capture)
    monkeypatch.setitem(BUILTIN_REWARDS, "parity", lambda completion, problem: float(len(completion) % 2 == 0))
    args = [
        "model.tokenizer=char",
        "model.hidden_size=32",
        "model.num_layers=2",
        "model.num_heads=2",
        "model.max_position_embeddings=32",
        "data.task=addition",
        "data.num_train=32",
        "data.num_eval=4",
        "rollout.num_prompts=2",
        "rollout.group_size=4",
        "rollout.max_new_tokens=4",
        "rollout.dtype=bf16",
        "rewards.functions=[parity]",
        "train.max_steps=2",
        "train.micro_batch_size=4",
        "train.save_every=0",
        "train.eval_every=0",
        "train.max_new_tokens=4",
        "train.threads=1",
        "optim.lr=1e-2",
        "logging.progress=false",
        "train.qat=ternary",
        f"train.output_dir={tmp_path / 'grpo'}",
    ]
    cfg = load_config(GRPOConfig, None, args)
    model, tok = load_model(cfg.model)
    run_grpo(cfg, model, tok)
    assert {m.scheme for m in model.modules() if isinstance(m, QATLinear)} == {"ternary"}
    rows = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 2 and all(math.isfinite(r["loss"]) for r in train)
    assert len(engines) == 1 and len(calls) == 2  # the rollouts came from the copy, one per step
    copy_model = engines[0].model
    assert copy_model is not model and next(copy_model.parameters()).dtype == torch.bfloat16

    # the copy's forward against the policy's, on the current weights
    engines[0].sync_weights(model)
    model.eval()
    x = torch.tensor([tok.encode("12+34=46")])
    with torch.no_grad():
        sampler = copy_model(x).logits.float()
        qat = model(x).logits.float()
        master = copy.deepcopy(model)
        for module in [m for m in master.modules() if isinstance(m, QATLinear)]:
            module.forward = lambda h, m=module: torch.nn.functional.linear(h, m.weight, m.bias)  # unquantized
        unquantized = master(x).logits.float()
    to_qat, to_master = (sampler - qat).abs().max().item(), (sampler - unquantized).abs().max().item()
    # bf16 rounding moves the logits by a few hundredths here; ternary quantization by tenths or more
    assert to_qat < 0.25 * to_master, (to_qat, to_master)
    assert json.loads((tmp_path / "grpo" / "final" / "config.json").read_text())["lmforge_qat"] == "ternary"
    with pytest.raises(ConfigError, match="train.qat needs rollout.backend=inprocess"):
        run_grpo(
            load_config(
                GRPOConfig,
                None,
                args[:-1] + [f"train.output_dir={tmp_path / 'v'}", "rollout.dtype=same", "rollout.backend=vllm"],
            )
        )


def test_train_qat_is_the_same_run_as_apply_qat_before_the_recipe(tmp_path):
    """``train.qat=ternary`` and ``apply_ternary_qat(model)`` before ``run_sft`` (how the numbers in
    docs/quantization.md were first measured) train bit-for-bit the same model."""
    from lmforge.quantize import apply_ternary_qat

    def losses(out):
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if r["kind"] == "train"]

    _, by_key, tok, _ = sft(tmp_path / "key", "train.qat=ternary", "train.max_steps=3", "train.eval_every=0")
    cfg = load_config(
        SFTConfig, None, ARGS + [f"train.output_dir={tmp_path / 'pre'}", "train.max_steps=3", "train.eval_every=0"]
    )
    by_hand, tok = load_model(cfg.model)
    apply_ternary_qat(by_hand)
    run_sft(cfg, by_hand, tok)
    assert losses(tmp_path / "key") == losses(tmp_path / "pre")
    for (name, a), b in zip(by_key.named_parameters(), by_hand.parameters()):
        assert torch.equal(a, b), name


@needs_ct
def test_pretrain_with_int4_qat_writes_a_readable_int8_copy(tmp_path):
    from lmforge.quantize.qat import int4_fake_quant
    from lmforge.recipes.pretrain import PretrainConfig, run_pretrain

    text = tmp_path / "a.txt"
    text.write_text("12+34=46\n7+5=12\n" * 100)
    fmt = "int8"
    out = tmp_path / "run"
    run_pretrain(
        load_config(
            PretrainConfig,
            None,
            [
                "model.tokenizer=char",
                "model.hidden_size=32",
                "model.num_layers=1",
                "model.num_heads=2",
                "model.max_position_embeddings=32",
                f"data.files=[{text}]",
                "data.seq_len=16",
                "data.cache=false",
                "train.max_steps=2",
                "train.batch_size=4",
                "train.micro_batch_size=4",
                "train.eval_every=0",
                "train.threads=1",
                "logging.progress=false",
                "train.qat=int4",
                f"train.save_quantized=[{fmt}]",
                f"train.output_dir={out}",
            ],
        )
    )
    assert json.loads((out / "final" / "config.json").read_text())["lmforge_qat"] == "int4"
    hf = dequantize(out / "final" / f"quantized-{fmt}", tmp_path / "hf")
    plain = load_plain(hf)
    # the copy holds the baked int4 weights, quantized again to int8: within int8's step of them
    master = load_plain(out / "final")
    w = master.get_submodule("model.layers.0.mlp.up_proj").weight.detach()
    copy_w = plain.get_submodule("model.layers.0.mlp.up_proj").weight.detach()
    baked = int4_fake_quant(w)
    step = baked.abs().amax(dim=1, keepdim=True) / 127
    assert ((copy_w - baked).abs() <= step).all() and not torch.equal(copy_w, w)
