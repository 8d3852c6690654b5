"""LoRA through PEFT (docs/lora.md) on tiny in-process models: only the adapters train and hold
optimizer state; the reference policy is the base model with the adapters off (no copy); SFT, GRPO
and PPO runs train the adapters and leave the base weights bit-identical; the saved adapter reloads
with peft and the merged directory with plain transformers, both giving the trained logits; resume
is bit-exact; the bf16 sampler copy holds the merged weights after an update."""

import copy
import json

import pytest
import torch
from run_records import assert_resume_is_bit_exact, records

from lmforge import rl
from lmforge.core.config import LoraConfig, ModelConfig, load_config
from lmforge.core.errors import ConfigError
from lmforge.model import lora
from lmforge.model.load import load_model
from lmforge.recipes.grpo import GRPOConfig, run_grpo
from lmforge.recipes.ppo import PPOConfig, run_ppo
from lmforge.recipes.sft import SFTConfig, run_sft
from lmforge.rl import loop as rl_loop
from lmforge.rollout import CastEngine

peft = pytest.importorskip("peft")

TINY = dict(name="tiny:llama", tokenizer="char", hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=32)
TINY_ARGS = [f"model.{k}={v}" for k, v in TINY.items()]
SFT_ARGS = TINY_ARGS + [
    "data.task=addition",
    "data.num_train=64",
    "data.num_val=16",
    "data.num_eval=8",
    "data.max_len=16",
    "train.max_steps=8",
    "train.micro_batch_size=8",
    "train.batch_size=16",
    "train.save_every=4",
    "train.keep_last=10",
    "train.eval_every=4",
    "train.max_new_tokens=4",
    "train.threads=1",
    "optim.lr=2e-2",
    "optim.schedule=constant",
    "logging.progress=false",
    "model.lora.r=4",
    "model.lora.save_merged=true",
]
GRPO_ARGS = TINY_ARGS + [
    "data.task=addition",
    "data.num_train=64",
    "data.num_eval=8",
    "rollout.num_prompts=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
    "rewards.functions=[parity]",
    "train.max_steps=4",
    "train.micro_batch_size=2",
    "train.save_every=2",
    "train.keep_last=10",
    "train.eval_every=2",
    "train.max_new_tokens=4",
    "train.threads=1",
    "optim.lr=5e-2",
    "logging.progress=false",
    "model.lora.r=4",
    "model.lora.alpha=8",
    # KL to the reference (the base with adapters off), two passes of two mini-batches: old logprobs recomputed
    "algo.preset=grpo",
    "algo.num_iterations=2",
    "algo.num_mini_batches=2",
]


def tiny():
    return load_model(ModelConfig(**TINY))


def base_weights(model) -> dict:
    """The base model's weights of a LoRA model, under plain HF names (a copy)."""
    return {lora.plain_name(n): p.detach().clone() for n, p in model.named_parameters() if ".lora_" not in n}


def randomise_adapters(model, seed=0):
    """lora_B starts at zero (the adapted model equals the base): give it values, as training would."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)


def logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[1, 5, 9, 12, 7, 3, 14, 2]])


# ----------------------------------------------------------------------------- the adapters


def test_only_adapters_require_grad_and_the_start_equals_the_base():
    model, _ = tiny()
    before = logits(model, IDS)
    names = [n for n, _ in model.named_parameters()]
    lora.apply_lora(model, LoraConfig(r=4))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # all-linear: every projection of both layers (7 per layer), not the LM head
    assert len(trainable) == 2 * 7 * 2 and not any("lm_head" in n for n in trainable)
    assert sorted(base_weights(model)) == sorted(names)
    assert torch.equal(logits(model, IDS), before)  # B = 0: the adapted model starts as the base


def test_reference_with_adapters_off_equals_the_base_model_and_copies_nothing():
    model, _ = tiny()
    base = copy.deepcopy(model)
    lora.apply_lora(model, LoraConfig(r=4))
    randomise_adapters(model)
    assert not torch.allclose(logits(model, IDS), logits(base, IDS), atol=1e-3)  # the adapters do something
    ref = rl.reference_model(model, kl_coef=0.04)
    assert isinstance(ref, lora.DisabledAdapters) and ref.model is model
    assert not any(isinstance(v, torch.nn.Module) for v in vars(ref).values() if v is not model)
    with lora.adapters_disabled(model):
        assert torch.equal(logits(model, IDS), logits(base, IDS))
    # switched back on afterwards, with the adapters' requires_grad restored
    assert not torch.allclose(logits(model, IDS), logits(base, IDS), atol=1e-3)
    assert all(p.requires_grad == (".lora_" in n) for n, p in model.named_parameters())


def test_reference_logprobs_are_the_base_models(tmp_path):
    """rl.batch_logprobs on the reference of a LoRA policy = on a separate copy of the base model."""
    from lmforge.runtime.optim import Precision

    model, tokenizer = tiny()
    base = copy.deepcopy(model)
    lora.apply_lora(model, LoraConfig(r=4))
    randomise_adapters(model)
    cfg = load_config(GRPOConfig, None, GRPO_ARGS)
    prompts = rl.build_prompts(cfg.data, tokenizer, seed=0)
    from lmforge.rollout import RewardSet

    rollout, _, _ = rl.sample_and_score(
        rl.PolicyEngine(model), tokenizer, prompts, [0, 1], cfg.rollout, RewardSet([("exact", 1.0)]), 0
    )
    batch = rl.pack_rollout(rollout, tokenizer.pad_token_id, need_rollout_logprobs=False)
    precision = Precision(torch.device("cpu"), torch.float32)
    got = rl.batch_logprobs(rl.reference_model(model, 0.04), batch, 4, 1.0, precision)
    want = rl.batch_logprobs(base, batch, 4, 1.0, precision)
    policy = rl.batch_logprobs(model, batch, 4, 1.0, precision)
    assert torch.equal(got, want)
    assert not torch.allclose(policy, want, atol=1e-4)


def test_sampler_copy_holds_the_merged_weights_after_an_update():
    model, _ = tiny()
    lora.apply_lora(model, LoraConfig(r=4, alpha=16))
    engine = CastEngine(model, torch.float32)
    assert not lora.has_adapters(engine.model)  # a plain model: no adapter matmuls while sampling
    randomise_adapters(model, seed=1)  # "an update"
    engine.sync_weights(model)
    merged = dict(lora.merged_named_parameters(model))
    layer = model.model.layers[0].self_attn.q_proj
    want_q = layer.base_layer.weight + (16 / 4) * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    assert torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"], want_q, atol=1e-6, rtol=0)
    for name, param in engine.model.named_parameters():
        assert torch.equal(param, merged[name]), name
    torch.testing.assert_close(logits(engine.model, IDS), logits(model, IDS), atol=1e-5, rtol=0)
    # the trained model was not merged in place: its adapters still work and switch off
    assert lora.has_adapters(model)
    with lora.adapters_disabled(model):
        assert not torch.allclose(logits(model, IDS), logits(engine.model, IDS), atol=1e-3)
    # a bf16 copy holds the merged weights rounded to bf16
    bf16 = CastEngine(model, torch.bfloat16)
    bf16.sync_weights(model)
    for name, param in bf16.model.named_parameters():
        assert param.dtype == torch.bfloat16 and torch.equal(param, merged[name].to(torch.bfloat16)), name


def test_config_errors_and_the_install_hint(monkeypatch):
    for override, key in [
        ("model.lora.r=-1", "model.lora.r"),
        ("model.lora.dropout=1.5", "model.lora.dropout"),
        ("model.lora.target_modules=[]", "target_modules"),
    ]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(SFTConfig, None, ["data.task=addition", "model.lora.r=4", override])
    model, _ = tiny()
    with pytest.raises(ConfigError, match="target_modules"):
        lora.apply_lora(model, LoraConfig(r=4, target_modules=["no_such_proj"]))
    # one good name and one that matches nothing: PEFT would adapt q_proj alone, silently
    with pytest.raises(ConfigError, match=r"'nope' matches no linear layer .*its linear layers: .*q_proj"):
        lora.apply_lora(tiny()[0], LoraConfig(r=4, target_modules=["q_proj", "nope"]))
    for embedding in ("embed_tokens", "lm_head"):
        with pytest.raises(ConfigError, match="embedding or the LM head"):
            lora.apply_lora(tiny()[0], LoraConfig(r=4, target_modules=[embedding]))

    class FSDP2:
        distributed, strategy = True, "fsdp2"

    cfg = load_config(SFTConfig, None, ["data.task=addition", "model.lora.r=4"])
    with pytest.raises(ConfigError, match="fsdp2"):
        lora.apply_for_run(tiny()[0], cfg.model.lora, cfg.train, FSDP2())
    for override in ("train.qat=int4", "train.save_quantized=[int8]"):
        cfg = load_config(SFTConfig, None, ["data.task=addition", "model.lora.r=4", override])
        with pytest.raises(ConfigError, match="lmforge quantize"):
            lora.apply_for_run(tiny()[0], cfg.model.lora, cfg.train)
    monkeypatch.setitem(__import__("sys").modules, "peft", None)  # "not installed"
    with pytest.raises(ConfigError, match=r"pip install 'lmforge\[lora\]'"):
        lora.apply_lora(tiny()[0], LoraConfig(r=4))


# ----------------------------------------------------------------------------- SFT


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft_lora") / "run"
    model, tokenizer = tiny()
    base = base_weights(model)
    run_sft(load_config(SFTConfig, None, SFT_ARGS + [f"train.output_dir={out}"]), model=model, tokenizer=tokenizer)
    return out, model, base


def test_sft_trains_the_adapters_only(sft_run):
    out, model, base = sft_run
    train = records(out)
    first, last = train[1]["loss"], train[8]["loss"]
    assert last < first - 0.2, (first, last)
    for name, value in base_weights(model).items():
        assert torch.equal(value, base[name]), f"base weight {name} moved"
    assert any(float(p.detach().abs().max()) > 0 for n, p in model.named_parameters() if ".lora_B." in n)


def test_sft_optimizer_state_is_for_the_adapters_only(sft_run):
    out, model, _ = sft_run
    state = torch.load(out / "checkpoints" / "step-000008" / "trainer_state.pt", weights_only=False)
    adapter_numels = sorted(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    moments = sorted(s["exp_avg"].numel() for s in state["optimizer"]["state"].values())
    assert moments == adapter_numels


def test_saved_adapter_reloads_with_peft_and_merged_dir_with_transformers(sft_run):
    from transformers import AutoModelForCausalLM

    out, model, _ = sft_run
    want = logits(model, IDS)
    reloaded = peft.PeftModel.from_pretrained(tiny()[0], str(out / "final"))
    assert torch.equal(logits(reloaded, IDS), want)
    merged = AutoModelForCausalLM.from_pretrained(str(out / "final" / "merged"))
    assert not any(".lora_" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged, IDS), want, atol=1e-5, rtol=0)


def test_sft_resume_with_lora_is_bit_exact(sft_run, tmp_path):
    out, _, _ = sft_run
    assert_resume_is_bit_exact(run_sft, SFTConfig, SFT_ARGS, out, tmp_path / "resumed", 4, ("loss", "grad_norm"))


def test_resuming_a_lora_checkpoint_without_lora_is_an_error(sft_run, tmp_path):
    out, _, _ = sft_run
    args = [a for a in SFT_ARGS if not a.startswith("model.lora")]
    with pytest.raises(ConfigError, match="model.lora"):
        run_sft(
            load_config(
                SFTConfig,
                None,
                args + [f"train.output_dir={tmp_path / 'r'}", f"train.resume={out / 'checkpoints' / 'step-000004'}"],
            )
        )


# ----------------------------------------------------------------------------- GRPO and PPO


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    """A GRPO run with a KL reference; records every model copy made (copy.deepcopy of a module) and
    the reference the run built."""
    out = tmp_path_factory.mktemp("grpo_lora") / "run"
    model, tokenizer = tiny()
    base = base_weights(model)
    copies, references = [], []
    deepcopy, reference_model = copy.deepcopy, rl.reference_model

    def counting_deepcopy(obj, *args, **kwargs):
        if isinstance(obj, torch.nn.Module):
            copies.append(type(obj).__name__)
        return deepcopy(obj, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(copy, "deepcopy", counting_deepcopy)
        mp.setattr(
            rl_loop, "reference_model", lambda m, kl: references.append(reference_model(m, kl)) or references[-1]
        )
        run_grpo(
            load_config(GRPOConfig, None, GRPO_ARGS + [f"train.output_dir={out}"]), model=model, tokenizer=tokenizer
        )
    return out, model, base, copies, references


def test_grpo_with_kl_builds_no_second_copy_of_the_weights(grpo_run):
    _, model, _, copies, references = grpo_run
    assert copies == []  # no module was copied in the whole run (a full fine-tuning run copies the policy)
    (ref,) = references
    assert isinstance(ref, lora.DisabledAdapters) and ref.model is model
    # the parameters the reference can reach are the policy's own tensors
    assert {p.data_ptr() for p in ref.model.parameters()} == {p.data_ptr() for p in model.parameters()}


def test_full_fine_tuning_reference_is_a_copy_the_lora_run_avoids():
    """The other side of the check above: without LoRA, the KL reference is a second model."""
    model, _ = tiny()
    ref = rl.reference_model(model, kl_coef=0.04)
    assert isinstance(ref, torch.nn.Module) and ref is not model
    assert not {p.data_ptr() for p in ref.parameters()} & {p.data_ptr() for p in model.parameters()}
    assert sum(p.numel() for p in ref.parameters()) == sum(p.numel() for p in model.parameters())


def test_grpo_with_kl_trains_the_adapters_against_the_base(grpo_run):
    out, model, base, _, _ = grpo_run
    train = records(out)
    assert sorted(train) == [1, 2, 3, 4]
    assert any(r["grad_norm"] > 0 for r in train.values())
    # k3 against the base: >= 0, and > 0 once the adapters have moved the policy (from the first step's
    # second update on; the adapters start at B = 0, where policy = reference)
    assert all(r["kl"] >= 0 for r in train.values()) and max(r["kl"] for r in train.values()) > 1e-4
    assert all(r["rollout_diff_abs_max"] < 1e-4 for r in train.values())  # sampler = trainer
    for name, value in base_weights(model).items():
        assert torch.equal(value, base[name]), f"base weight {name} moved"
    assert (out / "final" / "adapter_model.safetensors").is_file()
    assert not (out / "final" / "model.safetensors").exists()


def test_grpo_resume_with_lora_is_bit_exact(grpo_run, tmp_path):
    out, _, _, _, _ = grpo_run
    assert_resume_is_bit_exact(
        run_grpo, GRPOConfig, GRPO_ARGS, out, tmp_path / "resumed", 2, ("loss", "reward", "kl", "grad_norm")
    )


def test_grpo_with_a_bf16_sampler_copy_samples_the_merged_policy(tmp_path, monkeypatch):
    engines, sync = [], CastEngine.sync_weights
    monkeypatch.setattr(CastEngine, "sync_weights", lambda self, model: (engines.append(self), sync(self, model))[1])
    out = tmp_path / "run"
    model, tokenizer = tiny()
    args = [a for a in GRPO_ARGS if not a.startswith("algo.num_")] + [
        "rollout.dtype=bf16",
        "algo.is_level=token",
        "train.max_steps=2",
        f"train.output_dir={out}",
    ]
    run_grpo(load_config(GRPOConfig, None, args), model=model, tokenizer=tokenizer)
    assert len(engines) == 2  # before each rollout
    engine = engines[-1]
    sync(engine, model)  # the final weights
    merged = dict(lora.merged_named_parameters(model))
    for name, param in engine.model.named_parameters():
        assert torch.equal(param, merged[name].to(torch.bfloat16)), name
    assert all(r["rollout_diff_abs_max"] < 0.5 for r in records(out).values())  # bf16 rounding only


def test_ppo_trains_adapters_and_the_value_head(tmp_path, monkeypatch):
    from lmforge.runtime.optim import Updater

    modules, build = [], Updater.build.__func__
    monkeypatch.setattr(
        Updater,
        "build",
        classmethod(lambda cls, module, *a, **k: (modules.append(module), build(cls, module, *a, **k))[1]),
    )
    out = tmp_path / "run"
    model, tokenizer = tiny()
    base = base_weights(model)
    args = [a for a in GRPO_ARGS if not a.startswith(("algo.", "rewards."))] + [
        "rewards.functions=[parity]",
        "train.max_steps=2",
        f"train.output_dir={out}",
    ]
    run_ppo(load_config(PPOConfig, None, args), model=model, tokenizer=tokenizer)
    module = modules[0]
    trained = [n for n, p in module.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n or n.startswith("value_head.") for n in trained)
    assert any(n.startswith("value_head.") for n in trained)
    for name, value in base_weights(model).items():
        assert torch.equal(value, base[name]), f"base weight {name} moved"
    assert (out / "final" / "adapter_model.safetensors").is_file() and (out / "final" / "value_head.pt").is_file()


def test_export_of_a_lora_checkpoint_is_the_merged_model(sft_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from lmforge.cli import main

    out, model, _ = sft_run
    assert main(["export", str(out), "--out", str(tmp_path / "hf")]) == 0  # newest checkpoint = step 8 = final
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    torch.testing.assert_close(logits(exported, IDS), logits(model, IDS), atol=1e-5, rtol=0)


def test_antidistillation_with_a_lora_student(tmp_path):
    """The distill stage trains a LoRA student (adapter + merged dir); eval scores its merged model."""
    from test_antidistill_pipeline import ARGS as ADS_ARGS

    from lmforge.cli import main

    args = ADS_ARGS + ["sample.temperatures=[1.0]", "sample.lams=[0.0]", f"run.workdir={tmp_path}", "student.lora.r=4"]
    for stage in ("traces", "grad", "sample", "distill", "eval"):
        assert main(["antidistill", stage, *args]) == 0, stage
    final = tmp_path / "students" / "T1-lam0" / "final"
    assert (final / "adapter_model.safetensors").is_file() and (final / "merged" / "model.safetensors").is_file()
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert [s["name"] for s in results["students"]] == ["T1-lam0"]
    assert 0 <= results["students"][0]["student_accuracy"] <= 1


def test_lora_with_gradient_checkpointing_trains(tmp_path):
    """Checkpointed blocks with a frozen embedding still give the adapters their gradients."""
    out = tmp_path / "run"
    args = [a for a in SFT_ARGS if not a.startswith(("train.max_steps", "model.lora.save_merged"))]
    run_sft(
        load_config(
            SFTConfig,
            None,
            args + ["train.max_steps=2", "train.gradient_checkpointing='on'", f"train.output_dir={out}"],
        )
    )
    assert all(r["grad_norm"] > 0 for r in records(out).values())


def test_loading_an_adapter_directory_as_a_model_says_what_to_load_instead(sft_run):
    from lmforge.core.errors import ModelLoadError

    out, _, _ = sft_run
    with pytest.raises(ModelLoadError, match="LoRA adapter directory.*merged"):
        load_model(ModelConfig(name=str(out / "final")))


def test_vllm_gets_the_merged_weights_under_plain_names():
    from lmforge.rollout.vllm_backend import vllm_named_weights

    model, _ = tiny()
    plain = [n for n, _ in model.named_parameters()]  # tied: the embedding once, no lm_head
    lora.apply_lora(model, LoraConfig(r=4))
    randomise_adapters(model)
    weights = vllm_named_weights(model)
    assert [n for n, _ in weights] == plain
    merged = dict(lora.merged_named_parameters(model))
    layer = model.model.layers[1].mlp.down_proj
    assert not torch.equal(merged["model.layers.1.mlp.down_proj.weight"], layer.base_layer.weight)
    for name, tensor in weights:
        assert torch.equal(tensor, merged[name]), name


def test_weights_pushed_to_a_server_are_merged_under_plain_names():
    """rollout.backend=atropos pushes the policy to `lmforge serve`, which holds the plain model: a LoRA
    policy goes as its merged weights under the plain model's state-dict names, and the server's own
    check accepts them."""
    from safetensors.torch import load

    from lmforge.serve.weights import check_state, state_dict_bytes

    plain_model, _ = tiny()
    model = copy.deepcopy(plain_model)
    lora.apply_lora(model, LoraConfig(r=4))
    randomise_adapters(model)
    sent = load(state_dict_bytes(model))
    assert set(sent) == set(plain_model.state_dict())
    check_state(plain_model, sent)
    merged = dict(lora.merged_named_parameters(model))
    assert not torch.equal(
        sent["model.layers.0.self_attn.q_proj.weight"],
        plain_model.state_dict()["model.layers.0.self_attn.q_proj.weight"],
    )
    for name, tensor in merged.items():
        assert torch.equal(sent[name], tensor), name


def test_ppo_resume_with_lora_is_bit_exact(tmp_path):
    """Adapters and the value head both come back from the checkpoint."""
    args = [a for a in GRPO_ARGS if not a.startswith(("algo.", "rewards."))] + [
        "rewards.functions=[parity]",
        "algo.kl_coef=0.05",
    ]
    out = tmp_path / "run"
    run_ppo(load_config(PPOConfig, None, args + [f"train.output_dir={out}"]))
    assert_resume_is_bit_exact(
        run_ppo, PPOConfig, args, out, tmp_path / "resumed", 2, ("loss", "value_loss", "kl", "grad_norm")
    )


def test_lora_on_the_antidistillation_teacher_is_an_error():
    from lmforge.pipelines.antidistill import AntidistillConfig

    with pytest.raises(ConfigError, match=r"teacher\.lora\.r.*student\.lora\.r"):
        load_config(AntidistillConfig, None, ["teacher.lora.r=8"])


def test_unsupported_lora_settings_stop_before_the_run_directory_is_touched(tmp_path):
    from lmforge.runtime.run import start_run

    out = tmp_path / "run"
    cfg = load_config(
        SFTConfig, None, ["data.task=addition", "model.lora.r=4", "train.qat=int4", f"train.output_dir={out}"]
    )
    with pytest.raises(ConfigError, match="lmforge quantize"):
        start_run(cfg, "sft")
    assert not out.exists()
