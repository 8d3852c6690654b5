"""Episodes token-in / token-out, and the three proofs of issue 21: (a) the history holds the sampled
ids verbatim under a tokenizer whose decode -> encode is not the identity; (b) the loss trains exactly
the policy's tokens, and the same check catches a mask with one environment token switched on;
(c) a one-turn environment gives exactly the single-turn GRPO run."""

import threading
import time
import types
from pathlib import Path

import pytest
import torch
from episode_envs import Again, Hangs, Malformed, Raises
from run_records import records

from lmforge import rl
from lmforge.core.config import ModelConfig, load_config
from lmforge.core.errors import ConfigError, TrainingError
from lmforge.envs.base import StepResult
from lmforge.envs.episode import EpisodeLimits, EpisodeRunner
from lmforge.envs.tool_env import ToolEnv
from lmforge.losses.policy import PolicyLossSpec, policy_loss
from lmforge.model.load import load_model
from lmforge.model.tokenizer import ASCII_ALPHABET, DEFAULT_CHAT_TEMPLATE, char_tokenizer
from lmforge.recipes.grpo import GRPOConfig, run_grpo
from lmforge.rl.sources.episode_batch import episode_rollout
from lmforge.rollout import RolloutBatch, SamplingParams, generate
from lmforge.rollout.continuous import ContinuousDecoder, FinishedRow
from lmforge.runtime.optim import Precision

# Every runner test runs in both modes: rounds (EpisodeRunner.run) and continuous (run_continuous)
MODES = ["rounds", "continuous"]
SPECIALS = ["<pad>", "<bos>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>", "<|tool|>"]


def merging_tokenizer():
    """A BPE tokenizer with the merge a + b -> ab: the ids [a, b] decode to "ab", which encodes to [ab]."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list("\nab+=0123456789egin") + ["ab"])}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    bpe.decoder = decoders.Fuse()
    bpe.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    tok.chat_template = DEFAULT_CHAT_TEMPLATE
    return tok, vocab


def scripted(turns: list[list[int]], pad: int):
    """A generate function that answers round r with the ids ``turns[r]`` in every row (logprob -0.5 - i/10
    for the i-th id), and records the prompts it was given."""
    seen = []

    def generate_fn(prompts, params, num_samples):
        seen.append([list(p) for p in prompts])
        sampled = turns[len(seen) - 1]
        rows, n = len(prompts) * num_samples, len(sampled)
        ids = torch.tensor([sampled] * rows)
        ones = torch.ones(rows, n, dtype=torch.long)
        logprobs = torch.tensor([[-0.5 - i / 10 for i in range(n)]] * rows)
        prompt_ids = torch.full((rows, 1), pad)
        return RolloutBatch(
            prompt_ids,
            torch.ones(rows, 1, dtype=torch.long),
            ids,
            ones,
            logprobs,
            torch.arange(rows),
            torch.ones(rows, dtype=torch.long),
            torch.full((rows,), n),
            torch.zeros(rows, dtype=torch.bool),
        )

    return generate_fn, seen


class ScriptedDecoder:
    """``scripted`` for the continuous runner: turn t of every episode samples ``turns[t]``, finished in
    the step after its admission; ``seen[t]`` records the ids each turn t was admitted with."""

    def __init__(self, turns: list[list[int]]):
        self.turns, self.seen, self.queue, self.admitted = turns, [], [], {}

    @property
    def busy(self):
        return bool(self.queue)

    def admit(self, key, ids, params):
        turn = self.admitted[key] = self.admitted.get(key, -1) + 1
        self.seen += [[] for _ in range(turn + 1 - len(self.seen))]
        self.seen[turn].append(list(ids))
        self.queue.append((key, self.turns[turn]))

    def release(self, key):
        pass

    def step(self):
        rows = [
            FinishedRow(key, list(sampled), [-0.5 - i / 10 for i in range(len(sampled))], False)
            for key, sampled in self.queue
        ]
        self.queue = []
        return rows


def run_scripted(runner, mode, turns, problems, group_size, params):
    """Episodes of ``problems`` whose turn t samples ``turns[t]``, in ``mode``; ``seen[t]``: the ids of the
    engine inputs of turn t (in rounds, a group's shared first prompt once)."""
    if mode == "rounds":
        generate_fn, seen = scripted(turns, runner.tokenizer.pad_token_id)
        episodes, times = runner.run(generate_fn, problems, group_size, params)
    else:
        decoder = ScriptedDecoder(turns)
        episodes, times = runner.run_continuous(decoder, problems, group_size, params)
        seen = decoder.seen
    runner.close()
    return episodes, times, seen


@pytest.mark.parametrize("mode", MODES)
def test_history_holds_the_sampled_ids_verbatim_under_a_non_identity_tokenizer(mode):
    tok, vocab = merging_tokenizer()
    a, b, eos = vocab["a"], vocab["b"], vocab["<eos>"]
    turns = [[a, b, eos], [b, a, b, eos], [a, b, a, eos]]  # every turn has a, b as two tokens
    runner = EpisodeRunner(Again(turns=3), tok, EpisodeLimits(max_turns=3), workers=2)
    problem = types.SimpleNamespace(prompt="1+2=", answer="3")
    episodes, _, seen = run_scripted(
        runner, mode, turns, [problem], 2, SamplingParams(max_new_tokens=8, stop_token_ids=[eos], seed=0)
    )
    for episode in episodes:
        assert episode.end == "done" and episode.state.turn == 3
        sampled = [i for i, t in zip(episode.ids, episode.trained) if t]
        assert sampled == [i for turn in turns for i in turn]  # verbatim, stop tokens included
        assert [lp for lp, t in zip(episode.logprobs, episode.trained) if t] == pytest.approx(
            [-0.5 - i / 10 for turn in turns for i in range(len(turn))], abs=1e-7
        )
        assert all(lp == 0.0 for lp, t in zip(episode.logprobs, episode.trained) if not t)
        history = episode.prompt_ids + episode.ids
        # the ids stand for the template's rendering of the whole conversation...
        assert tok.decode(history) == runner.render(episode.state.messages[:-1]).text.rsplit("<|assistant|>", 1)[
            0
        ] + "<|assistant|>\n" + tok.decode(turns[-1])
        # ...yet re-encoding that text would change them: the tokenizer merges a, b into ab
        assert tok(tok.decode(history), add_special_tokens=False)["input_ids"] != history
        # each round's engine input was the previous history plus the new tokens, never re-encoded
        assert seen[2][0] == episode.prompt_ids + episode.ids[: len(seen[2][0]) - len(episode.prompt_ids)]
    # rounds: turn 0 is a group's shared prompt, sampled twice; continuous: one row per episode
    assert seen[0] == [episodes[0].prompt_ids] * (1 if mode == "rounds" else 2)


def test_later_rounds_do_not_reuse_the_next_steps_draws():
    """Round r of the batch sampled with seed s must not sample with the seed of round 0 at step s + r
    (step_seed steps by 1): two steps' episodes would share their random draws."""
    tok, vocab = merging_tokenizer()
    eos = vocab["<eos>"]
    seeds = {}
    for step_seed in (10, 11, 12):
        generate_fn, _ = scripted([[vocab["a"], eos]] * 3, tok.pad_token_id)
        used = []

        def recording(prompts, params, num_samples, inner=generate_fn, used=used):
            used.append(params.seed)
            return inner(prompts, params, num_samples)

        runner = EpisodeRunner(Again(turns=3), tok, EpisodeLimits(max_turns=3), workers=1)
        runner.run(
            recording,
            [types.SimpleNamespace(prompt="1+2=", answer="3")],
            2,
            SamplingParams(max_new_tokens=4, stop_token_ids=[eos], seed=step_seed),
        )
        runner.close()
        seeds[step_seed] = used
    assert [s[0] for s in seeds.values()] == [10, 11, 12]  # round 0: the step's own seed, as single-turn
    every = [seed for used in seeds.values() for seed in used]
    assert len(every) == 9 and len(set(every)) == 9


@pytest.mark.parametrize("mode", MODES)
def test_a_sentencepiece_style_tokenizer_passes_the_prefix_check_with_its_ids_verbatim(mode):
    # Metaspace decoding drops the leading space of a reply decoded on its own ("▁The" -> "The"): the
    # message and the rendering agree on that text, so the episode goes on, and the ids stay as sampled
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list("\u2581\nhiagne") + ["\u2581The", "\u2581cat"])}
    spm = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    spm.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    spm.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    spm.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=spm, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    tok.chat_template = DEFAULT_CHAT_TEMPLATE
    reply = [vocab["\u2581The"], vocab["\u2581cat"], vocab["<eos>"]]
    runner = EpisodeRunner(Again(turns=3), tok, EpisodeLimits(max_turns=3), workers=1)
    (episode,), _, _ = run_scripted(
        runner,
        mode,
        [reply] * 3,
        [types.SimpleNamespace(prompt="hi", answer="")],
        1,
        SamplingParams(max_new_tokens=8, stop_token_ids=[vocab["<eos>"]]),
    )
    assert episode.end == "done" and episode.state.turn == 3
    assert episode.state.messages[1] == {"role": "assistant", "content": "The cat"}
    assert [i for i, t in zip(episode.ids, episode.trained) if t] == reply * 3


def tiny(max_positions=256):
    return load_model(
        ModelConfig(
            name="tiny:llama",
            tokenizer="char",
            hidden_size=32,
            num_layers=2,
            num_heads=2,
            max_position_embeddings=max_positions,
        )
    )


class RecordingDecoder(ContinuousDecoder):
    """A ContinuousDecoder that records each finished row as an engine call ``([ids], rollout-like)``."""

    def __init__(self, model, pad_token_id, calls):
        super().__init__(model, pad_token_id)
        self.calls, self.inputs = calls, {}

    def admit(self, key, ids, params):
        self.inputs[key] = list(ids)
        super().admit(key, ids, params)

    def step(self):
        rows = super().step()
        for row in rows:
            self.calls.append(
                (
                    [self.inputs[row.key]],
                    types.SimpleNamespace(
                        completion_ids=torch.tensor([row.token_ids]), completion_lens=torch.tensor([len(row.token_ids)])
                    ),
                )
            )
        return rows


def run_tiny_episodes(
    env,
    limits=EpisodeLimits(max_turns=3, max_episode_tokens=64),
    group_size=2,
    seed=0,
    calls=None,
    mode="rounds",
    temperature=1.0,
    problems=None,
    workers=2,
):
    """Episodes of two problems with a tiny model in ``mode``; each engine call's (prompts, rollout) goes to
    ``calls`` (continuous: each finished row as a call)."""
    torch.manual_seed(0)
    model, tok = tiny()
    problems = problems or [types.SimpleNamespace(prompt=f"{i}+{i}=", answer=str(2 * i)) for i in (1, 2)]
    runner = EpisodeRunner(env, tok, limits, workers=workers)
    params = SamplingParams(temperature=temperature, max_new_tokens=6, stop_token_ids=[tok.eos_token_id], seed=seed)

    def sample(ids, p, n):
        rollout = generate(model, ids, p, num_samples=n, pad_token_id=tok.pad_token_id)
        if calls is not None:
            calls.append(([list(i) for i in ids for _ in range(n)], rollout))
        return rollout

    if mode == "rounds":
        episodes, times = runner.run(sample, problems, group_size, params)
    else:
        model.eval()
        decoder = RecordingDecoder(model, tok.pad_token_id, [] if calls is None else calls)
        episodes, times = runner.run_continuous(decoder, problems, group_size, params)
    runner.close()
    return model, tok, episodes, times


def sampled_positions(episode, calls) -> list[int]:
    """Where the engine's samples sit in the episode's ids (prompt included), found from the engine
    calls alone: a row's sample follows its input, and both are a prefix of the episode's ids."""
    full, positions = episode.prompt_ids + episode.ids, set()
    for inputs, rollout in calls:
        for row, history in enumerate(inputs):
            sample = rollout.completion_ids[row, : int(rollout.completion_lens[row])].tolist()
            kept = sample[: len(full) - len(history)]  # (a last reply may be cut to the token budget)
            if kept and full[: len(history)] == history and full[len(history) : len(history) + len(kept)] == kept:
                positions.update(range(len(history), len(history) + len(kept)))
    return sorted(positions)


def reference_grad(model, episodes, calls, advantages, temperature):
    """The GRPO policy gradient written out over the tokens the engine sampled: for each episode, -A *
    (mean over its sampled tokens of log p(token | everything before it)), averaged over the episodes
    (seq_mean_token_mean, ratio 1 on-policy)."""
    model.zero_grad()
    total = 0.0
    for episode, advantage in zip(episodes, advantages):
        ids = torch.tensor([episode.prompt_ids + episode.ids])
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float() / temperature, -1)
        sampled = sampled_positions(episode, calls)
        token_logprobs = torch.stack([logprobs[p - 1, ids[0, p]] for p in sampled])
        total = total - advantage * token_logprobs.mean()
    (total / len(episodes)).backward()
    return [p.grad.clone() for p in model.parameters()]


def loss_grad(model, rollout, advantages, temperature, pad):
    """The training path: pack the rollout, the logprobs of its trained tokens, the GRPO loss, backward."""
    model.zero_grad()
    batch = rl.pack_rollout(rollout, pad, need_rollout_logprobs=False).with_(advantages=advantages)
    logprobs, _ = rl.policy_logprobs(model, batch, temperature, Precision(torch.device("cpu"), torch.float32))
    loss, _ = policy_loss(
        logprobs,
        logprobs.detach(),
        batch.advantages,
        batch.trained_mask,
        PolicyLossSpec(loss_type="token_clip", aggregation="seq_mean_token_mean", eps_low=0.2, eps_high=0.2),
    )
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def assert_trains_exactly_the_policy_tokens(model, episodes, calls, rollout, pad):
    advantages = torch.tensor([1.0, -0.5, 2.0, -1.5])
    expected = reference_grad(model, episodes, calls, advantages, 0.7)
    got = loss_grad(model, rollout, advantages, 0.7, pad)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module", params=MODES)
def multi_turn(request):
    calls = []
    model, tok, episodes, _ = run_tiny_episodes(Again(turns=3), calls=calls, mode=request.param)
    assert all(e.state.turn == 3 and 0 in e.trained for e in episodes), "need episodes with environment tokens"
    return model, tok, episodes, calls, episode_rollout(episodes, 2, tok.pad_token_id)


def test_loss_trains_exactly_the_policy_tokens_of_every_turn(multi_turn):
    model, tok, episodes, calls, rollout = multi_turn
    assert int(rl.trained_spans(rollout.trained).amax()) == 3  # three separate spans per row
    assert_trains_exactly_the_policy_tokens(model, episodes, calls, rollout, tok.pad_token_id)


def test_sampler_logprobs_line_up_with_the_trainers_on_every_turn_after_packing(multi_turn):
    # the same weights in float32: the trainer's logprob of each trained token is the sampler's
    model, tok, episodes, calls, rollout = multi_turn
    batch = rl.pack_rollout(rollout, tok.pad_token_id, need_rollout_logprobs=True)
    with torch.no_grad():
        logprobs, _ = rl.policy_logprobs(model, batch, 1.0, Precision(torch.device("cpu"), torch.float32))
    trained = batch.trained_mask.bool()
    torch.testing.assert_close(logprobs[trained], batch.rollout_logprobs[trained], rtol=0, atol=1e-4)
    assert bool((batch.rollout_logprobs[~trained] == 0).all())


def test_a_mask_with_one_environment_token_switched_on_is_caught(multi_turn):
    model, tok, episodes, calls, rollout = multi_turn
    trained = rollout.trained_mask.clone()
    environment = ((trained == 0) & (rollout.completion_mask == 1)).nonzero()[0]  # the first environment token
    trained[environment[0], environment[1]] = 1
    broken = RolloutBatch(**{**vars(rollout), "trained_mask": trained})
    with pytest.raises(AssertionError):
        assert_trains_exactly_the_policy_tokens(model, episodes, calls, broken, tok.pad_token_id)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "env, end, metric",
    [
        (Raises(), "env_error", "env_errors"),
        (Malformed(), "malformed", "num_malformed_replies"),
        (Hangs(), "timeout", "tool_timeouts"),
    ],
)
def test_a_broken_environment_ends_its_episodes_counted(env, end, metric, mode):
    from lmforge.rl.sources.episode_batch import episode_metrics

    limits = EpisodeLimits(max_turns=3, max_episode_tokens=64, timeout_s=0.3)
    _, _, episodes, times = run_tiny_episodes(env, limits, mode=mode)
    assert [e.end for e in episodes] == [end] * 4
    assert all(e.num_trained > 0 for e in episodes)  # the turn that was sampled is kept
    assert episode_metrics(episodes, times)[metric] == 4


def shout(text: str) -> str:
    """Shout, at length.

    Args:
        text: what to shout
    """
    return text.upper() * 100_000


class Loud(ToolEnv):
    def __init__(self):
        super().__init__([shout])

    def finish(self, state, message):
        return StepResult([], {"answered": 1.0}, done=True)


@pytest.mark.parametrize("mode", MODES)
def test_a_megabyte_tool_result_is_cut_and_invalid_calls_end_the_episode_counted(mode):
    from lmforge.rl.sources.episode_batch import episode_metrics

    tok = char_tokenizer(ASCII_ALPHABET)
    eos = tok.eos_token_id
    call = '<tool_call>\n{"name": "shout", "arguments": {"text": "ab"}}\n</tool_call>'
    unknown = '<tool_call>\n{"name": "whisper", "arguments": {}}\n</tool_call>'
    turns = [tok(t, add_special_tokens=False)["input_ids"] + [eos] for t in (call, unknown, unknown, "never")]
    limits = EpisodeLimits(max_turns=8, max_episode_tokens=4000, max_tool_result_tokens=64, max_invalid_calls=2)
    runner = EpisodeRunner(Loud(), tok, limits, workers=1)
    encoded, encode = [], runner.encode
    runner.encode = lambda text: encoded.append(len(text)) or encode(text)
    episodes, times, seen = run_scripted(
        runner,
        mode,
        turns,
        [types.SimpleNamespace(prompt="hi", answer="")],
        1,
        SamplingParams(max_new_tokens=100, stop_token_ids=[eos]),
    )
    (episode,) = episodes
    assert max(encoded) < 10_000  # the 200,000 characters of the result were never tokenized whole
    assert episode.end == "invalid_calls" and episode.state.turn == 3 and len(seen) == 3  # the 4th turn never ran
    result = episode.state.messages[2]
    assert result["role"] == "tool" and result["content"] == "AB" * 32 + " [cut]"
    assert [i for i, t in zip(episode.ids, episode.trained) if t] == [i for turn in turns[:3] for i in turn]
    metrics = episode_metrics(episodes, times)
    assert metrics["num_tool_results_cut"] == 1 and metrics["num_invalid_tool_calls"] == 2
    assert metrics["num_truncated_invalid_calls"] == 1 and metrics["episodes_done_frac"] == 0.0


class BadReset(Again):
    """``Again``, whose reset raises on the prompt "raise" and returns no messages on "empty"."""

    def reset(self, problem, state):
        if problem.prompt == "raise":
            raise KeyError("no such problem")
        return [] if problem.prompt == "empty" else super().reset(problem, state)


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_reset_and_an_empty_reply_are_counted_and_the_others_go_on(mode):
    from lmforge.rl.sources.episode_batch import episode_metrics

    tok = char_tokenizer(ASCII_ALPHABET)
    eos = tok.eos_token_id
    runner = EpisodeRunner(BadReset(turns=2), tok, EpisodeLimits(max_turns=3), workers=2)
    problems = [types.SimpleNamespace(prompt=p, answer="") for p in ("raise", "ok", "empty")]
    episodes, times, seen = run_scripted(
        runner,
        mode,
        [[eos], [tok.convert_tokens_to_ids("x"), eos]],
        problems,
        2,
        SamplingParams(max_new_tokens=8, stop_token_ids=[eos]),
    )
    assert [e.end for e in episodes] == ["env_error", "env_error", "done", "done", "malformed", "malformed"]
    # only the good group was sampled (in rounds its prompt shared)
    assert seen[0] == [episodes[2].prompt_ids] * (1 if mode == "rounds" else 2)
    assert all(e.prompt_ids == [eos] and e.ids == [] for e in episodes[::4] + episodes[1::4])
    assert episodes[2].state.messages[1] == {"role": "assistant", "content": ""}  # the empty reply was stepped
    metrics = episode_metrics(episodes, times)
    assert metrics["env_errors"] == 2 and metrics["num_malformed_replies"] == 2 and metrics["num_empty_replies"] == 2
    assert episode_rollout(episodes, 2, tok.pad_token_id).trained[[0, 1, 4, 5]].sum() == 0


@pytest.mark.parametrize("mode", MODES)
def test_limits_end_episodes_and_are_counted(mode):
    from lmforge.rl.sources.episode_batch import episode_metrics

    _, _, episodes, times = run_tiny_episodes(
        Again(turns=5), EpisodeLimits(max_turns=2, max_episode_tokens=200), mode=mode
    )
    assert [e.end for e in episodes] == ["turns"] * 4 and episode_metrics(episodes, times)["num_truncated_turns"] == 4
    _, _, episodes, times = run_tiny_episodes(
        Again(turns=5), EpisodeLimits(max_turns=9, max_episode_tokens=20), mode=mode
    )
    assert all(e.end == "episode_tokens" and len(e.ids) <= 20 for e in episodes)
    assert episode_metrics(episodes, times)["num_truncated_episode_tokens"] == 4


TINY = [
    "model.tokenizer=char",
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.max_position_embeddings=64",
]
ARGS = TINY + [
    "data.task=addition",
    "data.num_train=64",
    "data.num_eval=4",
    "data.use_chat_template=on",
    "rollout.num_prompts=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
    "rewards.functions=[parity]",
    "train.max_steps=3",
    "train.micro_batch_size=2",
    "train.eval_every=0",
    "train.threads=1",
    "optim.lr=1e-2",
    "logging.progress=false",
    "algo.preset=grpo",
    "algo.num_iterations=2",
    "algo.num_mini_batches=2",
]


def test_a_one_turn_environment_gives_exactly_the_single_turn_run(tmp_path):
    # Rounds only: a round samples every episode from one generator, as a single-turn batch does; the
    # continuous runner gives each turn its own (greedy, the two modes agree: test below)
    plain = run_grpo(load_config(GRPOConfig, None, ARGS + [f"train.output_dir={tmp_path / 'plain'}"]))
    env = run_grpo(
        load_config(
            GRPOConfig,
            None,
            ARGS
            + [
                f"train.output_dir={tmp_path / 'env'}",
                "env.name=episode_envs:OneTurn",
                "env.max_episode_tokens=8",
                "env.continuous=false",
            ],
        )
    )
    plain_steps, env_steps = records(plain["run_dir"]), records(env["run_dir"])
    assert sorted(plain_steps) == sorted(env_steps) == [1, 2, 3]
    for step in plain_steps:
        for key in ("loss", "pg_loss", "kl", "reward", "reward_std", "grad_norm", "ratio_max", "completion_len_mean"):
            assert env_steps[step][key] == plain_steps[step][key], (step, key)
        assert env_steps[step]["turns_per_episode"] == 1.0
    from safetensors.torch import load_file

    plain_weights, env_weights = (load_file(Path(r["run_dir"]) / "final" / "model.safetensors") for r in (plain, env))
    assert plain_weights.keys() == env_weights.keys()
    assert all(torch.equal(plain_weights[k], env_weights[k]) for k in plain_weights)


@pytest.mark.parametrize("env", ["Raises", "Malformed"])
def test_a_batch_whose_environment_fails_on_every_episode_stops_the_run(tmp_path, env):
    # every episode has its first turn to train on, but no reward an environment gave
    with pytest.raises(TrainingError, match="no episode of this batch is usable.*they ended as"):
        run_grpo(
            load_config(
                GRPOConfig,
                None,
                ARGS
                + [f"train.output_dir={tmp_path / 'run'}", f"env.name=episode_envs:{env}", "env.max_episode_tokens=8"],
            )
        )


@pytest.mark.parametrize(
    "override, match",
    [
        (["env.max_turns=4"], "not used without env.name"),
        (["env.name=episode_envs:OneTurn", "rollout.backend=vllm"], "rollout.backend=vllm is not supported"),
        (["env.name=episode_envs:OneTurn", "data.use_chat_template=off"], "rendered through the chat template"),
        (["env.name=no_such_env"], "not a built-in environment"),
        (["env.name=episode_envs:Again", "env.args={rounds: 2}"], r"takes no argument\(s\) \['rounds'\]"),
        (["env.name=episode_envs:Recorder"], r"needs argument\(s\) \['path'\]"),
        (["rollout.backend=episodes"], "set env.name"),
    ],
)
def test_env_config_errors(tmp_path, override, match):
    with pytest.raises(ConfigError, match=match):
        run_grpo(load_config(GRPOConfig, None, ARGS + [f"train.output_dir={tmp_path / 'run'}"] + override))


MULTI = [a for a in ARGS if not a.startswith(("model.max_position_embeddings", "train.max_steps"))] + [
    "model.max_position_embeddings=128",
    "train.max_steps=4",
    "train.save_every=2",
    "train.keep_last=10",
    "env.name=episode_envs:Again",
    "env.args={turns: 2}",
    "env.max_episode_tokens=40",
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("overlap", [[], ["rollout.async_steps=1", "algo.is_level=token"]], ids=["sync", "async"])
def test_episode_runs_resume_bit_for_bit(tmp_path, overlap, mode):
    from run_records import assert_resume_is_bit_exact

    args = MULTI + overlap + [f"env.continuous={mode == 'continuous'}"]
    out = tmp_path / "run"
    run_grpo(load_config(GRPOConfig, None, args + [f"train.output_dir={out}"]))
    steps = records(out)
    assert all(r["turns_per_episode"] > 1 for r in steps.values())
    if not (overlap and mode == "continuous"):
        assert_resume_is_bit_exact(
            run_grpo,
            GRPOConfig,
            args,
            out,
            tmp_path / "resumed",
            2,
            ("loss", "reward", "kl", "grad_norm", "turns_per_episode"),
        )
        return
    # Overlapped + continuous: the loss uses the sampler's logprobs (algo.is_level=token), and in a
    # continuous batch a turn's batch mates depend on when environment steps return, which changes the
    # last bits of its logits (a CPU matmul's rounding depends on the batch). The tokens, so the rewards
    # and turns, resume exactly; the losses to rounding (a CI run saw 2.4e-6 relative).
    assert_resume_is_bit_exact(
        run_grpo, GRPOConfig, args, out, tmp_path / "resumed", 2, ("reward", "turns_per_episode")
    )
    want, got = records(out), records(tmp_path / "resumed")
    for step in sorted(got):
        for key in ("loss", "kl", "grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-9), (step, key)


def test_drafted_tokens_give_the_run_without_them(tmp_path):
    # env.draft_tokens only changes how many model calls decode the same tokens: the same episodes, so the
    # same rewards and turns, and losses equal up to the rounding of the sampler's differently shaped
    # forwards (the loss uses the trainer's own logprobs); the drafter's counters are logged
    args = MULTI + ["env.continuous=true", "train.max_steps=3", "rollout.max_new_tokens=12"]
    run_grpo(load_config(GRPOConfig, None, args + [f"train.output_dir={tmp_path / 'plain'}"]))
    run_grpo(load_config(GRPOConfig, None, args + ["env.draft_tokens=4", f"train.output_dir={tmp_path / 'drafted'}"]))
    plain, drafted = records(tmp_path / "plain"), records(tmp_path / "drafted")
    assert sorted(plain) == sorted(drafted) == [1, 2, 3]
    for step in plain:
        for key in ("reward", "turns_per_episode", "episode_len_mean", "completion_len_mean"):
            assert drafted[step][key] == plain[step][key], (step, key)
        for key in ("loss", "grad_norm"):
            assert drafted[step][key] == pytest.approx(plain[step][key], rel=1e-4, abs=1e-9), (step, key)
        assert "draft_acceptance" not in plain[step]
    # drafts were checked at every step; a random tiny model keeps few of them (tests/rollout/test_speculative.py
    # checks kept and rejected drafts token by token)
    for step in drafted:
        assert drafted[step]["draft_tokens_per_episode"] > 0 and 0 <= drafted[step]["draft_acceptance"] <= 1


def test_ppo_trains_on_episodes(tmp_path):
    from lmforge.recipes.ppo import PPOConfig, run_ppo

    args = [a for a in MULTI if not a.startswith(("algo.", "train.save_every", "train.max_steps"))]
    run_ppo(load_config(PPOConfig, None, args + ["train.max_steps=2", f"train.output_dir={tmp_path / 'ppo'}"]))
    steps = records(tmp_path / "ppo")
    assert sorted(steps) == [1, 2] and all(r["turns_per_episode"] > 1 and r["grad_norm"] > 0 for r in steps.values())


@pytest.mark.parametrize("mode", MODES)
def test_a_first_prompt_that_fills_the_context_gives_a_row_that_fits(mode):
    tok, vocab = merging_tokenizer()
    runner = EpisodeRunner(Again(turns=1), tok, EpisodeLimits(max_turns=2), workers=1, context=12)
    problems = [
        types.SimpleNamespace(prompt="1+2=", answer="3"),
        types.SimpleNamespace(prompt="1+2=1+2=1+2=", answer=""),
    ]
    episodes, _, seen = run_scripted(
        runner,
        mode,
        [[vocab["a"], vocab["<eos>"]]],
        problems,
        1,
        SamplingParams(max_new_tokens=8, stop_token_ids=[2], seed=0),
    )
    assert [e.end for e in episodes] == ["done", "episode_tokens"]
    assert episodes[1].prompt_ids == [tok.eos_token_id] and episodes[1].ids == []
    assert seen == [[episodes[0].prompt_ids]]  # the long one was never sampled


@pytest.mark.parametrize("mode", MODES)
def test_per_turn_rewards_sit_on_their_turns_last_policy_token(mode):
    from lmforge.recipes.ppo import episode_rewards
    from lmforge.rl.sources.episode_batch import combine_rewards

    tok, vocab = merging_tokenizer()
    a, eos = vocab["a"], vocab["<eos>"]
    runner = EpisodeRunner(Again(turns=2), tok, EpisodeLimits(max_turns=3), workers=1)
    problem = types.SimpleNamespace(prompt="1+2=", answer="3")
    (episode,), _, _ = run_scripted(
        runner, mode, [[a, a, eos], [a, eos]], [problem], 1, SamplingParams(max_new_tokens=8, stop_token_ids=[eos])
    )
    rollout = episode_rollout([episode], 1, tok.pad_token_id)
    rewards = combine_rewards([episode], None, rollout.completion_ids.shape[1])
    assert rewards.names == ["env_said", "env_turn"] and rewards.total.tolist() == [1.25]
    # Again gives 0.25 after turn 1 (ids 0-2: a a eos), 1.0 after turn 2 (the last two trained ids)
    last = int(rollout.trained[0].nonzero().max())
    expected = torch.zeros_like(rewards.turn_rewards)
    expected[0, 2], expected[0, last] = 0.25, 1.0
    assert torch.equal(rewards.turn_rewards, expected)
    # PPO: the turn's part on its turn, the rest (here: nothing) at the end; summed it is the episode's reward
    placed = episode_rewards(rewards.total, rewards.turn_rewards, rollout.trained)
    assert torch.equal(placed, expected)
    with_functions = episode_rewards(rewards.total + 0.5, rewards.turn_rewards, rollout.trained)
    assert with_functions[0, last] == 1.5 and with_functions[0, 2] == 0.25


# ----------------------------------------------------------------------------- the continuous runner


class SlowFor(Again):
    """``Again``, whose step sleeps ``delay_s`` for problems whose prompt starts with "9"; every step's
    start and end go to ``events`` in the order they happen."""

    def __init__(self, turns: int = 3, delay_s: float = 0.2, slow: str = "9"):
        super().__init__(turns)
        self.delay_s, self.slow, self.events = delay_s, slow, []

    def step(self, state, message):
        slow = state.problem.prompt.startswith(self.slow)
        self.events.append(("start", state.problem.prompt, state.turn))
        if slow:
            time.sleep(self.delay_s)
        self.events.append(("end", state.problem.prompt, state.turn))
        return super().step(state, message)


@pytest.mark.parametrize("max_episode_tokens", [64, 20], ids=["room", "cut"])
def test_greedy_continuous_episodes_are_the_round_based_ones(max_episode_tokens):
    # "cut": the token budget ends every episode, so both modes must cut a turn at the same place
    limits = EpisodeLimits(max_turns=3, max_episode_tokens=max_episode_tokens)
    _, _, rounds, _ = run_tiny_episodes(Again(turns=3), limits, temperature=0.0)
    _, _, continuous, _ = run_tiny_episodes(Again(turns=3), limits, temperature=0.0, mode="continuous")
    assert [e.end for e in rounds] == ["done" if max_episode_tokens == 64 else "episode_tokens"] * 4
    for r, c in zip(rounds, continuous):
        assert (c.prompt_ids, c.ids, c.trained, c.end, c.state.messages) == (
            r.prompt_ids,
            r.ids,
            r.trained,
            r.end,
            r.state.messages,
        )
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(r.logprobs), rtol=0, atol=2e-5)


def test_a_sampled_episode_does_not_depend_on_its_batch_mates_or_their_environments_timing():
    problems = [types.SimpleNamespace(prompt=f"{i}+{i}=", answer="") for i in (1, 2)]
    limits = EpisodeLimits(max_turns=3, max_episode_tokens=64)
    _, _, alone, _ = run_tiny_episodes(SlowFor(delay_s=0.0), limits, problems=problems, mode="continuous", seed=3)
    # the same episodes (same indices) with two more behind them, and one problem's steps slowed
    crowd = problems + [types.SimpleNamespace(prompt=f"9{i}=", answer="") for i in (3, 4)]
    slowed = [types.SimpleNamespace(prompt="9" + p.prompt, answer="") for p in problems]
    _, _, crowded, _ = run_tiny_episodes(
        SlowFor(delay_s=0.05, slow="9"), limits, problems=crowd, mode="continuous", seed=3, workers=4
    )
    _, _, late, _ = run_tiny_episodes(
        SlowFor(delay_s=0.05, slow="91"), limits, problems=slowed[:1] + problems[1:], mode="continuous", seed=3
    )
    assert len({tuple(e.ids) for e in alone}) == 4  # sampled: the episodes of a group differ
    for a, c in zip(alone, crowded):
        assert c.ids == a.ids and c.trained == a.trained
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(a.logprobs), rtol=0, atol=2e-5)
    # the slowed group's prompt differs, so compare its sampled turns only through the fast group
    assert [e.ids for e in late[2:]] == [e.ids for e in alone[2:]]
    _, _, other_seed, _ = run_tiny_episodes(SlowFor(delay_s=0.0), limits, problems=problems, mode="continuous", seed=4)
    assert [e.ids for e in other_seed] != [e.ids for e in alone]


class WaitsForTheOthers(Again):
    """``Again`` (3 turns) whose first step on problem "9+9=" waits, up to ``wait_s``, until every episode
    of the other problems has taken its last step; ``released`` holds whether each such wait saw that."""

    def __init__(self, others: int, wait_s: float):
        super().__init__(turns=3)
        self.others_left, self.wait_s, self.released = others, wait_s, []
        self.lock, self.others_done = threading.Lock(), threading.Event()

    def step(self, state, message):
        if state.problem.prompt == "9+9=" and state.turn == 1:
            self.released.append(self.others_done.wait(self.wait_s))
        elif state.problem.prompt != "9+9=" and state.turn == 3:
            with self.lock:
                self.others_left -= 1
                if not self.others_left:
                    self.others_done.set()
        return super().step(state, message)


@pytest.mark.parametrize("mode", MODES)
def test_a_waiting_environment_step_does_not_hold_up_the_other_episodes(mode):
    # continuous: while the "9+9=" group's first steps wait, the other group decodes and steps all its
    # turns; rounds: its next turn waits for them, so the waits end by their time limit
    env = WaitsForTheOthers(others=2, wait_s=20.0 if mode == "continuous" else 0.3)
    problems = [types.SimpleNamespace(prompt=p, answer="") for p in ("9+9=", "1+1=")]
    _, _, episodes, _ = run_tiny_episodes(
        env, EpisodeLimits(max_turns=3, max_episode_tokens=64, timeout_s=60), problems=problems, mode=mode, workers=4
    )
    assert all(e.end == "done" and e.state.turn == 3 for e in episodes)
    assert env.released == [mode == "continuous"] * 2


def test_a_failed_continuous_batch_leaves_no_environment_answer_to_the_next():
    tok, vocab = merging_tokenizer()
    a, eos = vocab["a"], vocab["<eos>"]

    class FailsOnTurn2(ScriptedDecoder):
        def step(self):
            if any(turn >= 1 for turn in self.admitted.values()):
                raise RuntimeError("the model failed")
            return super().step()

    env = SlowFor(turns=2, delay_s=0.3, slow="9")  # "9+9=": its first step still runs when the batch fails
    runner = EpisodeRunner(env, tok, EpisodeLimits(max_turns=3), workers=2)
    problems = [types.SimpleNamespace(prompt=p, answer="") for p in ("1+1=", "9+9=")]
    params = SamplingParams(max_new_tokens=8, stop_token_ids=[eos])
    with pytest.raises(RuntimeError, match="the model failed"):
        runner.run_continuous(FailsOnTurn2([[a, eos]] * 3), problems, 1, params)
    assert ("start", "9+9=", 1) in env.events and ("end", "9+9=", 1) not in env.events
    decoder = ScriptedDecoder([[a, eos]] * 3)
    (episode,), _ = runner.run_continuous(decoder, problems[:1], 1, params)  # no episode 1 for the stale answer
    runner.close()
    assert episode.state.turn == 2 and episode.end == "done"
    assert [len(turn) for turn in decoder.seen] == [1, 1]


def test_episode_evaluator_reports_success_turns_and_turns_to_solve(monkeypatch):
    """Scripted greedy games of guess_number (1-10, two guesses): every game guesses 3, then 5. Secret 3 is
    solved in one turn, 5 in two, 9 not: accuracy 2/3, mean turns 5/3, turns to solve (1 + 2) / 2."""
    from lmforge.data.problem import Problem
    from lmforge.rl.config import EnvConfig
    from lmforge.rl.sources import episodes as episode_source

    tok = char_tokenizer(ASCII_ALPHABET)
    eos = tok.eos_token_id
    generate_fn, _ = scripted(
        [tok.encode("3", add_special_tokens=False) + [eos], tok.encode("5", add_special_tokens=False) + [eos]],
        tok.pad_token_id,
    )
    monkeypatch.setattr(
        episode_source,
        "generate",
        lambda model, ids, params, num_samples, pad_token_id: generate_fn(ids, params, num_samples),
    )
    env_cfg = EnvConfig(name="guess_number", args={"max_guesses": 2, "speed_bonus": 0.0}, max_turns=2, continuous=False)
    problems = [Problem("guess 1-10", s, s) for s in ("3", "5", "9")]
    evaluate = episode_source.episode_evaluator(
        env_cfg, tok, problems, None, [], max_new_tokens=4, context=None, reward_timeout_s=5.0, reward_workers=1
    )
    try:
        metrics, played, totals = evaluate(None)
    finally:
        evaluate.close()
    assert [e.state.turn for e in played] == [1, 2, 2] and totals == [1.0, 1.0, 0.0]
    assert metrics["accuracy"] == pytest.approx(2 / 3) and metrics["eval_turns"] == pytest.approx(5 / 3)
    assert metrics["eval_turns_to_solve"] == pytest.approx(1.5)
