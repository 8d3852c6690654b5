"""QAT module swap: forward equals the ternarized model, the backward is straight-through, export matches."""

import copy

import pytest
import torch
from quant_helpers import PROMPT, load_plain, logits_of
from torch import nn

from lmforge.quantize import QuantizeError, apply_qat, apply_ternary_qat, bake_qat, dequantize, quantize_model
from lmforge.quantize.qat import QATLinear, int4_fake_quant
from lmforge.quantize.ternary import absmean_ternary


@pytest.fixture
def model_and_tok(tiny_dir):
    from transformers import AutoTokenizer

    return load_plain(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir)


def _ternarized_copy(model):
    """The independent formulation: plain nn.Linear layers whose weights are absmean-ternarized."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for layer in ref.model.layers:
            for module in layer.modules():
                if isinstance(module, nn.Linear):
                    q, scale = absmean_ternary(module.weight)
                    module.weight.copy_(q.float() * scale)
    return ref


def test_swap_replaces_only_decoder_linears_and_keeps_parameters(model_and_tok):
    model, _ = model_and_tok
    keys = list(model.state_dict())
    params = {name: p for name, p in model.named_parameters()}
    replaced = apply_ternary_qat(model)
    assert len(replaced) == 7 * 2  # q, k, v, o, gate, up, down in each of 2 layers
    assert all(isinstance(model.get_submodule(name), QATLinear) for name in replaced)
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    assert list(model.state_dict()) == keys
    assert all(p is params[name] for name, p in model.named_parameters())  # an optimizer built before still works
    with pytest.raises(ValueError, match="already applied"):
        apply_ternary_qat(model)


def test_forward_equals_ternarized_model_and_gradient_is_straight_through(model_and_tok):
    model, tok = model_and_tok
    ref = _ternarized_copy(model)
    apply_ternary_qat(model)
    ids = torch.tensor([tok.encode(PROMPT, add_special_tokens=False)])
    out, ref_out = model(ids, labels=ids), ref(ids, labels=ids)
    torch.testing.assert_close(out.logits, ref_out.logits, rtol=0, atol=1e-5)
    out.loss.backward()
    ref_out.loss.backward()
    # STE: the master weight gets exactly the gradient taken w.r.t. the ternary weight
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        torch.testing.assert_close(
            model.get_submodule(name).weight.grad, ref.get_submodule(name).weight.grad, rtol=1e-4, atol=1e-7
        )
    assert model.get_submodule("model.layers.0.self_attn.q_proj").weight.grad.abs().sum() > 0


def test_training_updates_master_weights_in_full_precision(model_and_tok):
    model, tok = model_and_tok
    apply_ternary_qat(model)
    weight = model.get_submodule("model.layers.0.mlp.up_proj").weight
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.tensor([tok.encode(PROMPT, add_special_tokens=False)])
    before = weight.detach().clone()
    model(ids, labels=ids).loss.backward()
    opt.step()
    assert weight.dtype == torch.float32 and not torch.equal(weight, before)
    assert weight.unique().numel() > 3  # the master weights are not ternary themselves


def test_baked_model_and_its_ternary_export_compute_the_qat_forward(model_and_tok, tmp_path):
    model, tok = model_and_tok
    apply_ternary_qat(model)
    qat_logits = logits_of(model, tok)
    assert len(bake_qat(model)) == 14
    assert not any(isinstance(m, QATLinear) for m in model.modules())
    torch.testing.assert_close(logits_of(model, tok), qat_logits, rtol=0, atol=1e-6)
    quantize_model(model, tok, "ternary", tmp_path / "t")
    dequantize(tmp_path / "t", tmp_path / "hf")
    torch.testing.assert_close(logits_of(load_plain(tmp_path / "hf"), tok), qat_logits, rtol=0, atol=1e-5)


def test_int4_fake_quant_hand_values_and_bad_group():
    w = torch.tensor([[7.0, -3.4, 2.6, 0.2] + [0.0] * 28])  # absmax 7 -> scale 1 -> W_hat = round(W)
    expected = torch.tensor([[7.0, -3.0, 3.0, 0.0] + [0.0] * 28])
    torch.testing.assert_close(int4_fake_quant(w), expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="does not divide in_features 48"):
        int4_fake_quant(torch.randn(4, 48))


def test_unknown_scheme_lists_valid(model_and_tok):
    with pytest.raises(ValueError, match="valid: ternary, int4"):
        apply_qat(model_and_tok[0], "int3")


def test_saved_qat_checkpoint_exports_what_training_computed(model_and_tok, tmp_path):
    """A run saves master weights + config.lmforge_qat; quantize bakes them, so the export is exact."""
    import json

    from lmforge.quantize import quantize

    model, tok = model_and_tok
    apply_ternary_qat(model)
    qat_logits = logits_of(model, tok)
    model.save_pretrained(tmp_path / "final")
    tok.save_pretrained(tmp_path / "final")
    assert json.loads((tmp_path / "final" / "config.json").read_text())["lmforge_qat"] == "ternary"
    master_logits = logits_of(load_plain(tmp_path / "final"), tok)  # plain transformers: unquantized
    assert (master_logits - qat_logits).abs().max() > 1e-2
    quantize(str(tmp_path / "final"), "ternary", tmp_path / "t")
    dequantize(tmp_path / "t", tmp_path / "hf")
    assert "lmforge_qat" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    torch.testing.assert_close(logits_of(load_plain(tmp_path / "hf"), tok), qat_logits, rtol=0, atol=1e-5)


def test_quantized_copies_next_to_a_checkpoint_leave_the_live_model_alone(model_and_tok, tmp_path):
    from lmforge.quantize import save_quantized_copies

    model, tok = model_and_tok
    apply_ternary_qat(model)
    qat_logits = logits_of(model, tok)
    with pytest.raises(QuantizeError, match="unknown format 'q3'"):
        save_quantized_copies(model, tok, tmp_path / "final", ["ternary", "q3"])
    assert not (tmp_path / "final").exists()
    results = save_quantized_copies(model, tok, tmp_path / "final", ["ternary", "ternary-5trit"])
    assert [r.files[0].parent.name for r in results] == ["quantized-ternary", "quantized-ternary-5trit"]
    assert isinstance(model.get_submodule("model.layers.0.mlp.up_proj"), QATLinear)  # still training
    dequantize(tmp_path / "final" / "quantized-ternary", tmp_path / "hf")
    torch.testing.assert_close(logits_of(load_plain(tmp_path / "hf"), tok), qat_logits, rtol=0, atol=1e-5)


@pytest.mark.skipif(not __import__("quant_helpers").HAS_CT, reason="needs compressed-tensors")
def test_int4_qat_checkpoint_exports_to_int4_g32_exactly(model_and_tok, tmp_path):
    """A saved int4-QAT run exported as int4-g32 and loaded by plain transformers computes the training
    forward (atol 1e-5: the stored scale max|W_hat|/7 equals the training scale up to an ulp). The
    compressed-tensors grid (max / 7.5) on the same baked weights would not: it rounds them again."""
    from lmforge.quantize import quantize, quantize_model

    model, tok = model_and_tok
    apply_qat(model, "int4")
    qat_logits = logits_of(model, tok)
    model.save_pretrained(tmp_path / "final")
    tok.save_pretrained(tmp_path / "final")
    quantize(str(tmp_path / "final"), "int4-g32", tmp_path / "q")
    torch.testing.assert_close(logits_of(load_plain(tmp_path / "q"), tok), qat_logits, rtol=0, atol=1e-5)
    # control: the same baked weights without the marker get compressed-tensors' own scale
    bake_qat(model)
    del model.lmforge_baked_qat
    quantize_model(model, tok, "int4-g32", tmp_path / "ct-grid")
    assert (logits_of(load_plain(tmp_path / "ct-grid"), tok) - qat_logits).abs().max() > 1e-2
