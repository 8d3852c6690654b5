"""Environment runs that fail for the user's reasons say so (issue 37 item 3): an environment whose
constructor raises (its server is down) is exit 2 naming the class, the file and line and the
exception, not "a bug in lmforge"; the default tiny model's context and env.max_episode_tokens fit."""

import socket
import textwrap

from run_records import TINY, records

from lmforge.cli import main
from lmforge.core.config import load_config
from lmforge.recipes.grpo import GRPOConfig, run_grpo
from lmforge.rl.config import EnvConfig

RUN = [
    "data.task=addition",
    "data.num_train=16",
    "data.num_eval=2",
    "data.use_chat_template=on",
    "rollout.num_prompts=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=4",
    "rewards.functions=[parity]",
    "train.max_steps=1",
    "train.eval_every=0",
    "train.threads=1",
    "logging.progress=false",
]
SMALL = [a for a in TINY if not a.startswith("model.max_position_embeddings")]  # the default context


def closed_port() -> int:
    """A local port nothing listens on (bound once, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_environment_whose_server_is_down_is_a_user_error_naming_class_file_and_line(tmp_path, monkeypatch, capsys):
    module = tmp_path / "down_env.py"
    module.write_text(
        textwrap.dedent("""\
        import socket


        class Remote:
            tools: list = []

            def __init__(self, port: int):
                self.server = socket.create_connection(("127.0.0.1", port), timeout=2)

            def reset(self, problem, state):
                return [{"role": "user", "content": problem.prompt}]

            def step(self, state, message):
                raise AssertionError("never reached")
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(
        [
            "grpo",
            *TINY,
            *RUN,
            "env.name=down_env:Remote",
            f"env.args={{port: {closed_port()}}}",
            "env.max_episode_tokens=8",
            f"train.output_dir={tmp_path / 'run'}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "env.name='down_env:Remote': down_env.Remote(**env.args) raised at " in err, err
    assert f"(called from {module}:8)" in err, err  # the environment's own line that called the library
    assert "ConnectionRefusedError: [Errno 111] Connection refused" in err, err
    assert "internal error" not in err and "bug in lmforge" not in err, err


def test_the_default_episode_budget_fits_the_default_tiny_context(tmp_path):
    cfg = load_config(GRPOConfig, None, [*SMALL, *RUN, "env.name=episode_envs:Again"])
    assert cfg.env.max_episode_tokens == EnvConfig().max_episode_tokens  # the defaults, as a new user gets them
    assert cfg.model.max_position_embeddings - cfg.env.max_episode_tokens >= 128  # room for a first prompt
    cfg.train.output_dir = str(tmp_path / "run")
    result = run_grpo(cfg)  # was: "env.max_episode_tokens=512 leaves no room for a prompt ... of 512 tokens"
    assert sorted(records(result["run_dir"])) == [1]


def test_an_episode_budget_past_a_tiny_context_names_both_keys(tmp_path, capsys):
    code = main(
        [
            "grpo",
            *TINY,
            *RUN,
            "env.name=episode_envs:Again",
            "env.max_episode_tokens=32",
            f"train.output_dir={tmp_path / 'run'}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert (
        "env.max_episode_tokens=32 leaves no room for a prompt in the model's context of 32 tokens "
        "(model.max_position_embeddings); lower env.max_episode_tokens or raise model.max_position_embeddings" in err
    ), err


def test_a_first_prompt_that_fills_the_context_is_a_config_error_naming_the_lengths_and_the_fixes(tmp_path, capsys):
    """The calculator's tools block spelled out by the 'char' tokenizer (623 tokens) in the default 512-token
    tiny context: every episode ended before its first turn, and the run said only 'no episode is usable'."""
    code = main(["grpo", *SMALL, *RUN, "env.name=calculator", f"train.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "the environment's first prompt is 62" in err and "the model's context is 512" in err, err
    assert "model.max_position_embeddings" in err and "model.tokenizer=char:ascii" in err, err
