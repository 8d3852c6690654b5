"""Every reader of a user file turns a bad file into a project error that names the file (issue 14).

One parametrised test feeds each reader the bad files it could meet (empty, binary, truncated, wrong
encoding, wrong schema) and checks for an LmforgeError whose message holds the path (and the line,
where the reader reads lines). Also here: nan/inf float settings, and the CLI's internal-error path.
"""

import shutil
import sys

import pytest
import torch

from lmforge import cli
from lmforge.core.config import ModelConfig, load_config, read_yaml
from lmforge.core.errors import ConfigError, LmforgeError
from lmforge.data.prompts import load_prompt_rows
from lmforge.data.sft import load_sft_rows
from lmforge.data.text import load_text_files, pack_documents
from lmforge.model.load import build_tiny, load_model, save_model
from lmforge.model.tokenizer import char_tokenizer, load_tokenizer, train_bpe_tokenizer
from lmforge.rollout.rewards import resolve_reward
from lmforge.runtime.checkpoint import load_model_weights, load_trainer_state

BINARY = bytes(range(256)) * 4  # NUL bytes and invalid UTF-8
LATIN1 = "caf\u00e9 au lait\n".encode("latin-1")  # 0xe9 alone is not UTF-8
UTF16 = "hello\n".encode("utf-16")  # with its byte-order mark
GOOD_ROW = b'{"prompt": "1+1=", "completion": "2"}\n'
TINY = ModelConfig(name="tiny:llama", hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)


def _parquet_bytes(tmp_path, table: dict) -> bytes:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "made.parquet"
    pq.write_table(pa.table(table), path)
    return path.read_bytes()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A saved tiny HF model directory (config.json, model.safetensors, tokenizer files)."""
    tok = char_tokenizer()
    out = tmp_path_factory.mktemp("hf") / "model"
    save_model(build_tiny("llama", TINY, tok), tok, out)
    return out


def _copy_dir(src, tmp_path):
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


# ----------------------------------------------------------------------------- one reader, one file each


def _sft_jsonl(tmp_path, content):
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    return path, lambda: load_sft_rows(path)


def _sft_parquet(tmp_path, content):
    path = tmp_path / "data.parquet"
    path.write_bytes(content(tmp_path) if callable(content) else content)
    return path, lambda: load_sft_rows(path)


def _prompts(tmp_path, content):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    return path, lambda: load_prompt_rows(path)


def _text(tmp_path, content):
    path = tmp_path / "doc.txt"
    path.write_bytes(content)
    return path, lambda: load_text_files([str(path)])


def _bpe(tmp_path, content):
    path = tmp_path / "corpus.txt"
    path.write_bytes(content)
    return path, lambda: train_bpe_tokenizer([path], vocab_size=300)


def _yaml(tmp_path, content):
    path = tmp_path / "run.yaml"
    path.write_bytes(content)
    return path, lambda: read_yaml(path)


def _model_config_json(tmp_path, content, model_dir):
    path = _copy_dir(model_dir, tmp_path)
    (path / "config.json").write_bytes(content)
    return path / "config.json", lambda: load_model(ModelConfig(name=str(path)))


def _model_dir_config(tmp_path, content, model_dir):  # errors only transformers finds name the directory
    path, read = _model_config_json(tmp_path, content, model_dir)
    return path.parent, read


def _model_weights(tmp_path, content, model_dir):
    path = _copy_dir(model_dir, tmp_path)
    weights = path / "model.safetensors"
    if content is None:
        weights.unlink()
    else:
        weights.write_bytes(content(weights.read_bytes()) if callable(content) else content)
    return path, lambda: load_model(ModelConfig(name=str(path)))


def _tokenizer_json(tmp_path, content, model_dir):
    path = _copy_dir(model_dir, tmp_path)
    (path / "tokenizer.json").write_bytes(content)
    return path, lambda: load_tokenizer(str(path))


def _gguf(tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    return path, lambda: load_model(ModelConfig(name=str(path)))


def _trainer_state(tmp_path, content):
    ckpt = tmp_path / "step-000001"
    ckpt.mkdir()
    path = ckpt / "trainer_state.pt"
    if callable(content):
        torch.save({"step": 1, "data": list(range(1000))}, path)
        path.write_bytes(content(path.read_bytes()))
    else:
        path.write_bytes(content)
    return path, lambda: load_trainer_state(ckpt)


def _checkpoint_weights(tmp_path, content, model_dir):
    ckpt = tmp_path / "step-000001"
    shutil.copytree(model_dir, ckpt / "model")
    weights = ckpt / "model" / "model.safetensors"
    weights.write_bytes(content(weights.read_bytes()) if callable(content) else content)
    model = build_tiny("llama", TINY, char_tokenizer())
    return weights, lambda: load_model_weights(model, ckpt)


def _stage_jsonl(tmp_path, content):
    from lmforge.antidistill.pipeline import read_jsonl

    path = tmp_path / "heldout.jsonl"
    path.write_bytes(content)
    return path, lambda: read_jsonl(path)


def _stage_json(tmp_path, content):
    from lmforge.antidistill.pipeline import read_json

    path = tmp_path / "results.json"
    path.write_bytes(content)
    return path, lambda: read_json(path)


def _gradient(tmp_path, content):
    from lmforge.antidistill.ads import load_gradient, save_gradient

    path = tmp_path / "grad.safetensors"
    if callable(content):
        save_gradient({"w": torch.ones(64, 64)}, {"num_traces": 3}, path)
        path.write_bytes(content(path.read_bytes()))
    else:
        path.write_bytes(content)
    return path, lambda: load_gradient(path)


def _metrics(tmp_path, content):
    from lmforge.runtime.metrics import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(content)
    return path, lambda: read_metrics(tmp_path)


def _half(data: bytes) -> bytes:
    return data[: len(data) // 2]


CASES = {  # id: (reader, content, expected line number in the message or None, words expected)
    "sft-jsonl-empty": (_sft_jsonl, b"", None, "no rows"),
    "sft-jsonl-binary": (_sft_jsonl, BINARY, 1, "a binary file"),
    "sft-jsonl-truncated": (_sft_jsonl, GOOD_ROW + b'{"prompt": "2+', 2, "invalid JSON"),
    "sft-jsonl-latin1": (
        _sft_jsonl,
        GOOD_ROW + b'{"prompt": "' + LATIN1.strip() + b'", "completion": "x"}',
        2,
        "not UTF-8 text",
    ),
    "sft-jsonl-utf16": (_sft_jsonl, GOOD_ROW.decode().encode("utf-16"), None, "UTF-16"),
    "sft-jsonl-schema": (_sft_jsonl, GOOD_ROW + b'{"text": "hello"}\n', 2, "'prompt' and 'completion'"),
    "sft-jsonl-not-object": (_sft_jsonl, b"[1, 2]\n", 1, "expected a JSON object"),
    "sft-parquet-empty": (_sft_parquet, b"", None, "Parquet"),
    "sft-parquet-binary": (_sft_parquet, BINARY, None, "Parquet"),
    "sft-parquet-jsonl": (_sft_parquet, GOOD_ROW, None, "Parquet"),
    "sft-parquet-truncated": (
        _sft_parquet,
        lambda d: _half(_parquet_bytes(d, {"prompt": ["a"] * 50, "completion": ["b"] * 50})),
        None,
        "Parquet",
    ),
    "sft-parquet-schema": (_sft_parquet, lambda d: _parquet_bytes(d, {"text": ["a", "b"]}), None, "row 1"),
    "prompts-empty": (_prompts, b"\n\n", None, "no rows"),
    "prompts-binary": (_prompts, BINARY, 1, "a binary file"),
    "prompts-truncated": (_prompts, b'{"prompt": "1+1="}\n{"prompt', 2, "invalid JSON"),
    "prompts-latin1": (_prompts, b'{"prompt": "1+1="}\n' + LATIN1, 2, "not UTF-8 text"),
    "prompts-schema": (_prompts, b'{"question": "1+1="}\n', 1, "'prompt' string"),
    "text-empty": (_text, b"   \n", None, "empty"),
    "text-binary": (_text, BINARY, 1, "a binary file"),
    "text-truncated-utf8": (_text, "line one\nna\u00efve".encode()[:-3], 2, "not UTF-8 text"),
    "text-latin1": (_text, b"fine\nfine\n" + LATIN1, 3, "not UTF-8 text"),
    "text-utf16": (_text, UTF16, None, "UTF-16"),
    "bpe-empty": (_bpe, b"", None, "no text"),
    "bpe-binary": (_bpe, BINARY, 1, "a binary file"),
    "bpe-latin1": (_bpe, LATIN1, 1, "not UTF-8 text"),
    "yaml-binary": (_yaml, BINARY, 1, "a binary file"),
    "yaml-truncated": (_yaml, b"optim:\n  lr: [0.001, 0.002\n", None, "not valid YAML"),
    "yaml-latin1": (_yaml, b"# " + LATIN1, 1, "not UTF-8 text"),
    "yaml-utf16": (_yaml, "optim:\n  lr: 0.1\n".encode("utf-16"), None, "UTF-16"),
    "yaml-schema": (_yaml, b"- optim\n- train\n", None, "mapping"),
    "model-config-empty": (_model_config_json, b"", None, "config.json"),
    "model-config-binary": (_model_config_json, BINARY, None, "config.json"),
    "model-config-truncated": (_model_config_json, b'{"model_type": "llama", "hidden_', None, "config.json"),
    "model-config-schema": (_model_config_json, b'[{"model_type": "llama"}]', None, "expected an object"),
    "model-config-no-type": (_model_dir_config, b'{"hidden_size": 16}', None, "model_type"),
    "model-weights-missing": (_model_weights, None, None, "safetensors"),
    "model-weights-empty": (_model_weights, b"", None, "safetensors"),
    "model-weights-binary": (_model_weights, BINARY, None, "safetensors"),
    "model-weights-truncated": (_model_weights, _half, None, "safetensors"),
    "tokenizer-empty": (_tokenizer_json, b"", None, "tokenizer"),
    "tokenizer-binary": (_tokenizer_json, BINARY, None, "tokenizer"),
    "tokenizer-truncated": (_tokenizer_json, b'{"version": "1.0", "model": {', None, "tokenizer"),
    "tokenizer-schema": (_tokenizer_json, b'{"version": "1.0"}', None, "tokenizer"),
    "gguf-empty": (_gguf, b"", None, "not a GGUF file"),
    "gguf-binary": (_gguf, BINARY, None, "not a GGUF file"),
    "gguf-text": (_gguf, GOOD_ROW, None, "not a GGUF file"),
    "trainer-state-empty": (_trainer_state, b"", None, "truncated or corrupt"),
    "trainer-state-binary": (_trainer_state, BINARY, None, "truncated or corrupt"),
    "trainer-state-truncated": (_trainer_state, _half, None, "truncated or corrupt"),
    "trainer-state-schema": (_trainer_state, lambda d: _torch_bytes([1, 2, 3]), None, "expected a dict"),
    "ckpt-weights-empty": (_checkpoint_weights, b"", None, "truncated or corrupt"),
    "ckpt-weights-binary": (_checkpoint_weights, BINARY, None, "truncated or corrupt"),
    "ckpt-weights-truncated": (_checkpoint_weights, _half, None, "truncated or corrupt"),
    "stage-jsonl-binary": (_stage_jsonl, BINARY, 1, "a binary file"),
    "stage-jsonl-truncated": (_stage_jsonl, GOOD_ROW + b'{"prompt": "1', 2, "invalid JSON"),
    "stage-jsonl-schema": (_stage_jsonl, GOOD_ROW + b'"just a string"\n', 2, "expected a JSON object"),
    "stage-json-empty": (_stage_json, b"", None, "invalid JSON"),
    "stage-json-latin1": (_stage_json, LATIN1, 1, "not UTF-8 text"),
    "stage-json-schema": (_stage_json, b"[1, 2]", None, "expected a JSON object"),
    "gradient-empty": (_gradient, b"", None, "truncated or corrupt"),
    "gradient-binary": (_gradient, BINARY, None, "truncated or corrupt"),
    "gradient-truncated": (_gradient, _half, None, "truncated or corrupt"),
    "metrics-binary": (_metrics, BINARY, 1, "a binary file"),
    "metrics-bad-middle-line": (_metrics, b'{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n', 2, "invalid JSON"),
    "metrics-schema": (_metrics, b'{"step": 1}\n[2]\n', 2, "expected a JSON object"),
}
NEEDS_MODEL_DIR = (_model_config_json, _model_dir_config, _model_weights, _tokenizer_json, _checkpoint_weights)


def _torch_bytes(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("case", list(CASES))
def test_bad_file_is_a_project_error_naming_the_path(case, tmp_path, request):
    reader, content, line, words = CASES[case]
    extra = (request.getfixturevalue("model_dir"),) if reader in NEEDS_MODEL_DIR else ()
    path, read = reader(tmp_path, content, *extra)
    with pytest.raises(LmforgeError) as info:
        read()
    message = str(info.value)
    assert str(path) in message, message
    if line is not None:
        assert f"{path}:{line}:" in message, message
    assert words in message, message


def test_good_files_still_read(tmp_path, model_dir):
    """The readers above accept the good versions of the same files (so the cases test the fault)."""
    (tmp_path / "d.jsonl").write_bytes(b"\xef\xbb\xbf" + GOOD_ROW)  # a UTF-8 byte-order mark is fine
    assert load_sft_rows(tmp_path / "d.jsonl") == [{"prompt": "1+1=", "completion": "2"}]
    (tmp_path / "d.parquet").write_bytes(_parquet_bytes(tmp_path, {"prompt": ["a"], "completion": ["b"]}))
    assert load_sft_rows(tmp_path / "d.parquet") == [{"prompt": "a", "completion": "b"}]
    (tmp_path / "doc.txt").write_text("na\u00efve text\n", encoding="utf-8")
    assert load_text_files([str(tmp_path / "doc.txt")]) == ["na\u00efve text\n"]
    (tmp_path / "run.yaml").write_text("optim:\n  lr: 0.5\n")
    assert read_yaml(tmp_path / "run.yaml") == {"optim": {"lr": 0.5}}
    model, tok = load_model(ModelConfig(name=str(model_dir)))
    assert len(tok) == model.get_input_embeddings().num_embeddings
    assert len(load_tokenizer(str(model_dir))) == len(tok)


def test_metrics_log_cut_short_by_a_kill_is_read_without_its_last_line(tmp_path, capsys):
    from lmforge.runtime.metrics import read_metrics

    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.25}\n{"step": 3, "lo')
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.25}]
    assert f"{tmp_path / 'metrics.jsonl'}:3: leaving out the last line" in capsys.readouterr().out


def test_a_directory_where_a_file_is_expected(tmp_path):
    (tmp_path / "data.jsonl").mkdir()
    (tmp_path / "doc.txt").mkdir()
    with pytest.raises(LmforgeError, match="data.jsonl: SFT data file not found"):
        load_sft_rows(tmp_path / "data.jsonl")
    with pytest.raises(LmforgeError, match="doc.txt: directory contains no .txt files"):
        load_text_files([str(tmp_path / "doc.txt")])


def test_gguf_with_the_magic_but_garbage_names_the_file(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + BINARY)
    with pytest.raises(LmforgeError) as info:
        load_model(ModelConfig(name=str(path)))
    assert str(path) in str(info.value) and "cannot read this GGUF file" in str(info.value)


def test_corrupt_data_cache_is_rebuilt_with_a_warning(tmp_path, caplog):
    tok = char_tokenizer()
    docs = ["1+2=3\n" * 40, "4+5=9\n" * 40]
    first = pack_documents(docs, tok, seq_len=16, cache_dir=tmp_path)
    (cache_file,) = tmp_path.glob("packed-*.pt")
    cache_file.write_bytes(_half(cache_file.read_bytes()))
    again = pack_documents(docs, tok, seq_len=16, cache_dir=tmp_path)
    assert not again.from_cache and torch.equal(again.train, first.train)
    assert str(cache_file) in caplog.text and "ignoring the unreadable data cache" in caplog.text
    assert pack_documents(docs, tok, seq_len=16, cache_dir=tmp_path).from_cache, "rewritten"


# ----------------------------------------------------------------------------- reward modules


@pytest.mark.parametrize(
    "source, expected",
    [
        ("def reward(:\n    pass\n", "SyntaxError"),
        ("x = 1\nraise RuntimeError('no GPU here')\n", "RuntimeError: no GPU here"),
        ("def other(completion, problem):\n    return 1.0\n", "has no callable 'reward'"),
        ("reward = 3\n", "has no callable 'reward'"),
    ],
)
def test_broken_reward_module_names_the_file(tmp_path, monkeypatch, source, expected):
    name = f"bad_reward_{abs(hash(source)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        resolve_reward(f"{name}:reward")
    message = str(info.value)
    assert str(tmp_path / f"{name}.py") in message and expected in message, message
    if expected in ("SyntaxError", "RuntimeError: no GPU here"):
        assert f"{name}.py:{1 if expected == 'SyntaxError' else 2}" in message, message
    sys.modules.pop(name, None)


@pytest.mark.parametrize("spec", ["no_such_module_xyz:reward", ":reward", "json:"])
def test_reward_spec_that_cannot_resolve(spec):
    with pytest.raises(ConfigError, match="reward"):
        resolve_reward(spec)


# ----------------------------------------------------------------------------- nan / inf floats


@pytest.mark.parametrize(
    "override",
    [
        "optim.lr=nan",
        "optim.lr=inf",
        "optim.lr=-inf",
        "optim.lr=.nan",
        "optim.beta2=Infinity",
        "optim.max_grad_norm=NaN",
    ],
)
def test_float_settings_reject_non_finite(override):
    from lmforge.recipes.sft import SFTConfig

    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"config key '{key}': expected a finite number"):
        load_config(SFTConfig, None, [override])


def test_non_finite_float_in_yaml_names_the_key(tmp_path):
    from lmforge.recipes.grpo import GRPOConfig

    (tmp_path / "run.yaml").write_text("parallel:\n  timeout_s: .inf\n")
    with pytest.raises(ConfigError, match="'parallel.timeout_s': expected a finite number"):
        load_config(GRPOConfig, tmp_path / "run.yaml")
    cfg = load_config(GRPOConfig, None, ["parallel.timeout_s=1e3", "optim.lr=3e-4", "data.task=addition"])
    assert cfg.parallel.timeout_s == 1000.0 and cfg.optim.lr == 3e-4


def test_optional_float_rejects_non_finite_but_accepts_null():
    import dataclasses

    from lmforge.core.config import _build, opt

    @dataclasses.dataclass
    class Section:
        clip: float | None = opt(None, "optional float")

    assert _build(Section, {"clip": None}).clip is None
    assert _build(Section, {"clip": "0.5"}).clip == 0.5
    with pytest.raises(ConfigError, match="'clip': expected a finite number, got 'nan'"):
        _build(Section, {"clip": "nan"})


# ----------------------------------------------------------------------------- the CLI


def _fail_in_recipe(monkeypatch, exc):
    """`lmforge sft` runs a recipe that raises ``exc`` (the CLI looks its run function up when it builds
    the command; monkeypatch puts the real one back after the test)."""
    from lmforge.recipes import sft

    def broken(cfg):
        raise exc

    monkeypatch.setattr(sft, "run_sft", broken)


def test_cli_internal_error_exit_1_with_a_traceback_log(tmp_path, monkeypatch, capsys):
    _fail_in_recipe(monkeypatch, RuntimeError("shape mismatch in step\nsecond line"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    code = cli.main(["sft", "data.task=addition", f"train.output_dir={run_dir}"])
    assert code == 1
    err = capsys.readouterr().err
    assert "lmforge sft: internal error: RuntimeError: shape mismatch in step\n" in err
    assert "second line" not in err and "please report it" in err
    (log,) = run_dir.glob("lmforge-error-*.log")
    assert f"full traceback: {log}" in err
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "second line" in text and "in broken" in text
    assert text.startswith("lmforge sft data.task=addition")


def test_cli_internal_error_without_a_run_dir_logs_to_a_temp_file(tmp_path, monkeypatch, capsys):
    _fail_in_recipe(monkeypatch, KeyError("x"))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    code = cli.main(["sft", "data.task=addition", f"train.output_dir={tmp_path / 'not-created'}"])
    assert code == 1
    (log,) = tmp_path.glob("lmforge-error-*.log")
    assert f"full traceback: {log}" in capsys.readouterr().err and "KeyError" in log.read_text()


@pytest.mark.parametrize("exc", [ConfigError("data.path: bad"), FileNotFoundError("nope.jsonl")])
def test_cli_user_error_exit_2_without_a_log(tmp_path, monkeypatch, capsys, exc):
    _fail_in_recipe(monkeypatch, exc)
    code = cli.main(["sft", "data.task=addition", f"train.output_dir={tmp_path}"])
    assert code == 2
    assert "error:" in capsys.readouterr().err and not list(tmp_path.glob("lmforge-error-*"))


def test_cli_bad_data_file_is_a_user_error(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_bytes(LATIN1)
    code = cli.main(["sft", f"data.path={data}", f"train.output_dir={tmp_path / 'run'}"])
    assert code == 2
    assert f"{data}:1: not UTF-8 text (byte 0xe9 is invalid there); the SFT data file" in capsys.readouterr().err


def test_cli_nan_learning_rate_is_a_user_error(capsys):
    assert cli.main(["sft", "data.task=addition", "optim.lr=nan"]) == 2
    assert "config key 'optim.lr': expected a finite number, got 'nan'" in capsys.readouterr().err


def test_cli_disk_full_is_a_user_error_that_says_so(tmp_path, monkeypatch, capsys):
    import errno

    _fail_in_recipe(monkeypatch, OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.pt")))
    assert cli.main(["sft", "data.task=addition", f"train.output_dir={tmp_path}"]) == 2
    assert f"No space left on device: '{tmp_path / 'x.pt'}'" in capsys.readouterr().err
    assert not list(tmp_path.glob("lmforge-error-*"))


def test_cli_other_os_error_is_internal(tmp_path, monkeypatch, capsys):
    _fail_in_recipe(monkeypatch, OSError("socket closed"))
    assert cli.main(["sft", "data.task=addition", f"train.output_dir={tmp_path}"]) == 1
    assert "internal error: OSError: socket closed" in capsys.readouterr().err
    assert len(list(tmp_path.glob("lmforge-error-*.log"))) == 1


def test_cli_output_dir_that_is_a_file(tmp_path, capsys):
    target = tmp_path / "run"
    target.write_text("not a directory")
    assert cli.main(["sft", "data.task=addition", f"train.output_dir={target}"]) == 2
    assert f"train.output_dir '{target}' is a file" in capsys.readouterr().err
