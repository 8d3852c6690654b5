"""Multi-turn GRPO on one environment: lmforge's episode runner vs TRL 1.16's ``GRPOTrainer(environment_factory=…)``.

What can run on both sides. TRL's environment_factory continues an episode only through tool calls: the
environment's answers are role "tool" messages, and an episode ends at the first reply without a
parsable tool call (trl/trainer/grpo_trainer.py, ``_tool_call_loop``). So each environment here is a TRL
environment class (``reset`` returns the text TRL appends to the empty user message; its public methods
are the tools), and lmforge plays the same class through ``ToolLoop`` (loaded as
``env.name=bench_env_vs_trl:CalcGame`` or ``:MoveGame``), which answers a reply as TRL's loop does: each
parsed call is run and answered by a tool message with its result (or ``{'error': …}``, an unknown tool
with TRL's error text), and a reply without a tool call ends the episode, scored by the class's
``_score`` of that reply (TRL: the reward function ``trl_reward``, the same ``_score``; 0 when an episode
ends at a limit instead). Two environments (``--env``):

- ``calculator`` (default): ``Calc``, a three-digit multiplication (``data.task=multiplication:digits=3``)
  behind the tool ``calculator(expression)`` (``lmforge.envs.calculator.calculator``); reward 1 when the
  final reply is the exact product. Both sides start from ``--start``, the warm model of
  examples/grpo_calculator.yaml (the SFT runs in examples/sft_calculator.yaml's header, ~10 min: it
  can call the tool and copy, but greedy it answers at once with an estimate, 0% held-out), with that
  example's settings: 8 problems x 8 episodes, temperature 0.6, lr 2e-5, <= 3 replies, <= 200 tokens;
  lmforge decodes with that example's ``env.draft_tokens: 8`` (``--draft-tokens``).
- ``textarena``: ``Arena``, TextArena's GuessTheNumber-v0 (unmodified, dealt by seed through
  ``lmforge.envs.textarena``) behind the tool ``move(action)``; reward the game's for player 0. Both
  sides start from a tiny random Llama trained here for ``--sft-steps`` on a bisecting player's tool
  calls (``warm_up``); 2 games x 4 episodes, temperature 0.5, lr 1e-4, <= 8 replies, <= 400 tokens.
  Neither side has learnt this one in the runs so far (docs/benchmarks.md).

Same tokens on both sides: the char-level tokenizer (``char:ascii``) with one chat template, TEMPLATE:
char:ascii's own tool template (tools listed in one line) that also renders assistant ``tool_calls`` as
Hermes ``<tool_call>`` blocks, so that TRL accepts it, with a ``response_template`` so that TRL can parse
the calls. lmforge's replies carry their calls as text, which TEMPLATE renders as the checkpoint's own
template does (checked on a whole episode); the script checks that TRL's first prompt ids equal lmforge's.

Same algorithm settings: group-normalised advantages, ``--prompts`` problems x ``--group`` episodes per
step, temperature ``--temperature``, no top-k / top-p, clip 0.2 / 0.2, no KL (TRL ``beta=0``), one
iteration and one mini-batch, per-episode token mean then mean over episodes (lmforge
``seq_mean_token_mean``, TRL ``loss_type="grpo"``; zero-advantage episodes count in the mean on both
sides -- lmforge does not run their forward and backward, whose gradient is exactly 0: the same update,
tests/recipes/test_grpo.py), AdamW at ``--lr`` constant, betas (0.9, 0.999), no weight decay, grad-norm
clip 1.0, fp32. Each side runs the batch's forward and backward in micro-batches of ``--micro-batch``
rows (lmforge ``train.micro_batch_size``; TRL ``per_device_train_batch_size`` with
``gradient_accumulation_steps`` making up the batch): the same update as one micro-batch on both sides
(both normalise by the whole batch), and faster on both here. lmforge's speculative decoding
(``--draft-tokens``, ``env.draft_tokens``) draws every token as decoding one token at a time draws it
(tests/rollout/test_speculative.py): an engine setting, not an algorithm one. Episode limits:
``--episode-tokens`` tokens after the first prompt
(lmforge ``env.max_episode_tokens`` = TRL ``max_completion_length``; a reply may use what is left of it:
lmforge ``rollout.max_new_tokens`` = the same number), ``--turns`` replies (lmforge ``env.max_turns``; TRL
``max_tool_calling_iterations`` = turns - 1). The same problems at each step: TRL's dataset is the
problems lmforge's prompt order draws, step by step, read unshuffled (``shuffle_dataset=False``). Not the
same: the sampling's random numbers, and the advantage's std epsilon (1e-6 lmforge, 1e-4 TRL). TRL generates
with ``model.generate`` (its default); ``--trl-continuous-batching`` switches it to transformers'
continuous batching, which was slower here (docs/benchmarks.md).

Timing: TRL drives (``trainer.train()``); at each of its ``on_step_end`` one lmforge step runs, so the
two alternate and share the machine's load. TRL's step time is the wall time between two
``on_step_end`` calls minus lmforge's step and the evaluations. Every ``--eval-every`` steps both models
play the same ``--eval-games`` held-out problems (the task's test split) greedily through lmforge's
evaluator (``rl.sources.episodes.episode_evaluator``, the same code for both, not timed); a success is
an episode with reward 1. Printed: episodes per second of training steps for each side, their ratio,
and for each ``--target`` each side's training time until the held-out success rate first reached it
(or "not reached") and the ratio trl / lmforge of those times.

    python benchmarks/bench_env_vs_trl.py                        # calculator, 8 steps, seed 0
    python benchmarks/bench_env_vs_trl.py --seed 1
    python benchmarks/bench_env_vs_trl.py --env textarena --steps 8 --eval-every 4 --eval-games 16
    python benchmarks/bench_env_vs_trl.py --quick                # a few steps, to see it run
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import tempfile
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # env.name=bench_env_vs_trl:MoveGame
if __name__ == "__main__":  # env.name imports this module by name: let it find this one, not a second copy
    sys.modules.setdefault("bench_env_vs_trl", sys.modules["__main__"])

GAME = "GuessTheNumber-v0"
# How TEMPLATE renders an assistant message's ``tool_calls`` (TRL renders them; lmforge's replies carry
# their calls as text, so for lmforge TEMPLATE is char:ascii's own tool template)
CALLS = (
    "{% for call in message.get('tool_calls') or [] %}{% set fn = call.get('function', call) %}"
    "{{ '<tool_call>\n' + {'name': fn['name'], 'arguments': fn['arguments']} | tojson + '\n</tool_call>' }}"
    "{% endfor %}"
)
TEMPLATE = (
    "{% if tools %}{{ '<|system|>\n' }}{% for tool in tools %}{% set fn = tool.get('function', tool) %}"
    "{{ fn['name'] + '(' + (fn.get('parameters', {}).get('properties', {}) | join(', ')) + ')' }}"
    "{% if not loop.last %}{{ ' ' }}{% endif %}{% endfor %}{{ eos_token + '\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + (message['content'] or '') }}"
    + CALLS
    + "{{ eos_token + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": "</tool_call>\\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": "<eos>\\s*", "content": "text"},
    },
}
_GAMES: dict = {}  # the one TextArenaGame (lmforge.envs.textarena), built on first use


def textarena_game():
    if "game" not in _GAMES:
        from lmforge.envs.textarena import TextArenaGame

        _GAMES["game"] = TextArenaGame(GAME)
    return _GAMES["game"]


# TRL's environment classes. TRL makes every public method but ``reset`` and ``get_reward`` a tool, so
# what is not a tool starts with ``_``: ``_row`` (an lmforge Problem -> the dataset row whose fields TRL
# passes to ``reset``), ``_score`` (the reward of an episode ended by the plain reply ``final``) and
# ``_played`` (set by ``reset``: which problem the episode plays).

PLAYED: dict = {"trl": set(), "lmforge": set()}  # the problems each side played since the last clear()


class Arena:
    """One TextArena game behind the tool ``move`` (``--env textarena``, module doc)."""

    @staticmethod
    def _row(problem) -> dict:
        return {"seed": int(problem.answer)}

    def reset(self, seed, **_) -> str:
        from lmforge.envs.base import EpisodeState

        self._played = int(seed)
        self._state = EpisodeState({"answer": str(seed)})
        self._reward, self._over = 0.0, False
        return textarena_game().reset(self._state.problem, self._state)[0]["content"]

    def move(self, action: str) -> str:
        """Make a move in the game.

        Args:
            action: the move, e.g. [10]
        """
        if self._over:
            return "the game is over"
        result = textarena_game().step(self._state, {"role": "assistant", "content": action})
        if result.done:
            self._over, self._reward = True, result.reward["game"]
            return "game over"
        return result.messages[0]["content"]

    def _score(self, final: str) -> float:
        return self._reward


class Calc:
    """One multiplication problem behind the tool ``calculator`` (``--env calculator``, module doc)."""

    @staticmethod
    def _row(problem) -> dict:
        return {"question": problem.prompt, "answer": problem.answer}

    def reset(self, question, answer, **_) -> str:
        self._answer, self._played = str(answer), question
        return question

    def calculator(self, expression: str) -> str:
        """Evaluate an integer arithmetic expression with + - * and parentheses.

        Args:
            expression: the expression, e.g. 123*456
        """
        from lmforge.envs.calculator import calculator

        return calculator(expression)

    def _score(self, final: str) -> float:
        return float(final.strip() == self._answer)


def trl_reward(completions, environments, **_) -> list[float]:
    """TRL's reward function: ``_score`` of the final reply when the episode ended with a plain reply
    (no tool call), else 0 (it ended at a limit) -- as lmforge's side scores it."""
    rewards = []
    PLAYED["trl"].update(environment._played for environment in environments)
    for messages, environment in zip(completions, environments):
        last = messages[-1]
        plain = last.get("role") == "assistant" and not last.get("tool_calls")
        rewards.append(environment._score(last.get("content") or "") if plain else 0.0)
    return rewards


class ToolLoop:
    """lmforge's side: one instance of the TRL environment class ``game`` per episode, replies answered
    as TRL's tool loop answers them: each parsed call is run and answered by a tool message with its
    result (or ``{'error': …}``, an unknown tool with TRL's error text); a reply without a tool call
    ends the episode with ``_score`` of that reply."""

    game: type

    def __init__(self):
        from lmforge.envs.toolcalls import function_schema

        instance = self.game()
        # TRL's tools: the class's public methods but reset
        self.tool_names = [
            name
            for name in sorted(vars(self.game))
            if not name.startswith("_") and name != "reset" and callable(getattr(instance, name))
        ]
        self.tools = [function_schema(getattr(instance, name)) for name in self.tool_names]

    def reset(self, problem, state):
        state.info["game"] = game = self.game()
        messages = [{"role": "user", "content": game.reset(**self.game._row(problem))}]
        PLAYED["lmforge"].add(game._played)
        return messages

    def step(self, state, message):
        from lmforge.envs.base import StepResult
        from lmforge.envs.toolcalls import parse_tool_calls

        game, calls = state.info["game"], parse_tool_calls(message["content"]).calls
        if not calls:
            return StepResult([], {"game": game._score(message["content"])}, done=True)
        replies = []
        for call in calls:
            state.counts["tool_calls"] = state.counts.get("tool_calls", 0) + 1
            try:
                if call.name not in self.tool_names:
                    raise ValueError(f"Tool {call.name} not found.")
                result = getattr(game, call.name)(**call.arguments)
            except Exception as exc:  # noqa: BLE001 -- as TRL: the error goes back to the model
                result = {"error": str(exc)}
            replies.append({"role": "tool", "name": call.name, "content": str(result)})
        return StepResult(replies, {}, done=False)


class MoveGame(ToolLoop):
    game = Arena


class CalcGame(ToolLoop):
    game = Calc


# ----------------------------------------------------------------------------- the warm start


def bench_model(seed: int = 0):
    from lmforge.core.config import ModelConfig
    from lmforge.model.load import load_model

    torch.manual_seed(seed)
    model, tok = load_model(
        ModelConfig(
            name="tiny:llama",
            tokenizer="char:ascii",
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            max_position_embeddings=2048,
        )
    )
    tok.chat_template = TEMPLATE
    tok.response_template = RESPONSE_TEMPLATE
    return model, tok


def demonstration(tok, tools, seed: int) -> tuple[list[int], list[int]]:
    """A bisecting player's game of ``seed`` as ids and a mask of its replies (the assistant's tokens)."""
    from lmforge.envs.base import EpisodeState
    from lmforge.envs.toolcalls import ToolCall, format_tool_calls, render_messages

    env, state = MoveGame(), EpisodeState(types.SimpleNamespace(answer=str(seed)))
    messages, low, high = env.reset(state.problem, state), 1, 20
    ids, mask = [], []
    while True:
        guess = (low + high) // 2
        reply = format_tool_calls([ToolCall("move", {"action": f"[{guess}]"}, "c")]) if low <= high else "done"
        before = render_messages(tok, messages, tools, add_generation_prompt=True)
        new = tok(before, add_special_tokens=False)["input_ids"][len(ids) :]
        reply_ids = tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids, mask = ids + new + reply_ids, mask + [0] * len(new) + [1] * len(reply_ids)
        messages.append({"role": "assistant", "content": reply})
        result = env.step(state, messages[-1])
        if result.done:
            return ids, mask
        messages += result.messages
        news = result.messages[0]["content"]
        if "higher" in news:
            low = guess + 1
        elif "lower" in news:
            high = guess - 1
        else:  # won ("game over"): the next reply ends the episode
            low, high = 1, 0


def warm_up(model, tok, seeds: list[int], steps: int, lr: float = 1e-2, batch: int = 4) -> float:
    """``steps`` AdamW steps of next-token loss on the demonstrations' replies; returns the seconds."""
    tools = MoveGame().tools
    demos = [demonstration(tok, tools, s) for s in seeds]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng, start = random.Random(0), time.perf_counter()
    model.train()
    for _ in range(steps):
        chosen = rng.sample(demos, batch)
        width = max(len(ids) for ids, _ in chosen)
        ids = torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i, _ in chosen])
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m in chosen], dtype=torch.float32)
        logits = model(input_ids=ids).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(
        f"[bench] warm-up: {steps} steps on {len(demos)} scripted games, last loss {loss.item():.3f} "
        f"({time.perf_counter() - start:.0f} s)",
        flush=True,
    )
    return time.perf_counter() - start


# ----------------------------------------------------------------------------- the two trainers

# What differs between the two environments; every key but env and task is also a command-line option (main).
SETTINGS = {
    # GuessTheNumber from a 120-step warm-up of a random model (bench_model, warm_up)
    "textarena": dict(
        env="MoveGame",
        task="seeds",
        steps=30,
        prompts=2,
        group=4,
        turns=8,
        episode_tokens=400,
        temperature=0.5,
        lr=1e-4,
        eval_every=10,
        eval_games=32,
        target=[0.5],
        micro_batch=0,
        draft_tokens=0,
    ),
    # multiplication with the calculator tool from examples/grpo_calculator.yaml's start and settings
    "calculator": dict(
        env="CalcGame",
        task="multiplication:digits=3",
        steps=8,
        prompts=8,
        group=8,
        turns=3,
        episode_tokens=200,
        temperature=0.6,
        lr=2e-5,
        eval_every=1,
        eval_games=200,
        target=[0.5, 0.6, 0.7, 0.8],
        micro_batch=16,
        draft_tokens=8,
    ),
}


def lmforge_state(model, tok, args, out_dir: str):
    """The state ``run_grpo`` builds (``rl.prepare``) with the environment and the settings of the module doc."""
    from lmforge import rl
    from lmforge.core.config import load_config
    from lmforge.recipes.grpo import GRPOConfig

    cfg = load_config(
        GRPOConfig,
        None,
        [
            f"data.task={args.task}",
            "data.num_train=4096",
            "data.num_eval=0",
            "data.use_chat_template='on'",
            f"env.name=bench_env_vs_trl:{args.env}",
            f"env.max_turns={args.turns}",
            f"env.max_episode_tokens={args.episode_tokens}",
            "env.max_invalid_calls=0",
            "env.workers=2",
            f"env.draft_tokens={args.draft_tokens}",
            f"rollout.num_prompts={args.prompts}",
            f"rollout.group_size={args.group}",
            f"rollout.temperature={args.temperature}",
            "rollout.top_k=0",
            "rollout.top_p=1.0",
            f"rollout.max_new_tokens={args.episode_tokens}",
            "rewards.functions=[]",
            "algo.advantage=group_norm",
            "algo.loss_type=token_clip",
            "algo.aggregation=seq_mean_token_mean",
            "algo.skip_zero_advantage=true",
            "algo.eps_low=0.2",
            "algo.eps_high=0.2",
            "algo.kl_coef=0.0",
            "algo.entropy_coef=0.0",
            "algo.num_iterations=1",
            "algo.num_mini_batches=1",
            f"optim.lr={args.lr}",
            "optim.schedule=constant",
            "optim.warmup_steps=0",
            "optim.weight_decay=0.0",
            "optim.beta1=0.9",
            "optim.beta2=0.999",
            "optim.eps=1e-8",
            "optim.max_grad_norm=1.0",
            f"train.micro_batch_size={args.micro_batch or args.prompts * args.group}",
            "train.gradient_checkpointing='off'",
            "train.dtype=fp32",
            "train.device=cpu",
            f"train.seed={args.seed}",
            f"train.max_steps={args.steps}",
            f"train.output_dir={out_dir}",
            "train.save_every=0",
            "train.eval_every=0",
            "logging.progress=false",
            f"train.threads={args.threads}",  # sets the whole process's threads, TRL's too
        ],
    )
    algo = cfg.algo.resolved()
    return rl.prepare(cfg, "bench_env_vs_trl", algo, model=model, tokenizer=tok), algo, cfg


def trl_trainer(model, tok, args, out_dir: str, callback, train_problems: list):
    from datasets import Dataset
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    hf_logging.set_verbosity_error()
    game = globals()[args.env].game
    micro = (args.micro_batch if args.trl_micro_batch is None else args.trl_micro_batch) or args.prompts * args.group
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": ""}], **game._row(p)} for p in train_problems])
    # read in order: row i is the problem lmforge plays at step i // prompts + 1 (lmforge_problems)
    config = TRLConfig(
        output_dir=out_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=args.prompts * args.group // micro,
        num_generations=args.group,
        max_completion_length=args.episode_tokens,
        max_tool_calling_iterations=args.turns - 1,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        epsilon=0.2,
        loss_type="grpo",
        scale_rewards="group",
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=args.seed,
        log_completions=False,
        shuffle_dataset=False,
        use_transformers_continuous_batching=args.trl_continuous_batching,
    )
    return GRPOTrainer(
        model=model,
        args=config,
        reward_funcs=[trl_reward],
        train_dataset=dataset,
        processing_class=tok,
        environment_factory=game,
        callbacks=[callback],
    )


def lmforge_problems(state, steps: int) -> list:
    """The problems lmforge's source plays at steps 1..``steps``, in order: a copy of its prompt order
    (``BatchOrder``, the run's own) drawn ahead, so that the run itself draws the same ones."""
    from lmforge.runtime.optim import BatchOrder

    setup = state.source.setup
    order = BatchOrder(setup.order.num_rows, setup.order.batch_rows, setup.order.seed)
    order.load_state_dict(setup.order.state_dict())
    return [setup.prompts.problems[row] for _ in range(steps) for row in order.next()]


def check_same_prompt(trainer, state, args, problem) -> None:
    """TRL's first prompt ids for a problem equal lmforge's (same template, tools, observation)."""
    from lmforge.envs.base import EpisodeState
    from lmforge.envs.toolcalls import render_messages

    env = globals()[args.env]()
    episode = EpisodeState(problem)
    text = render_messages(state.tokenizer, env.reset(episode.problem, episode), env.tools, add_generation_prompt=True)
    ours = state.tokenizer(text, add_special_tokens=False)["input_ids"]
    game = env.game()
    prompt = [{"role": "user", "content": game.reset(**game._row(problem))}]
    tools = [getattr(game, t["function"]["name"]) for t in env.tools]
    theirs = trainer.processing_class.apply_chat_template(
        prompt, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    print(
        f"[bench] first-prompt token ids identical on both sides: {list(theirs) == list(ours)} ({len(ours)} tokens)",
        flush=True,
    )


def start_model(args):
    """Both sides' warm start: the bench's warm-up (textarena) or the checkpoint ``--start`` (calculator)."""
    if args.env_name == "textarena":
        model, tok = bench_model()
        warm_up(model, tok, [int(p.answer) for p in args.train_problems[:256]], args.sft_steps)
        return model, tok
    from lmforge.core.config import ModelConfig
    from lmforge.envs.toolcalls import ToolCall, format_tool_calls, render_messages
    from lmforge.model.load import load_model

    if not os.path.isdir(args.start):
        sys.exit(
            f"--start {args.start}: no such checkpoint directory; make it with the three commands in "
            f"examples/sft_calculator.yaml's header (~10 min on 2 cores), or pass the path of yours"
        )
    model, tok = load_model(ModelConfig(name=args.start, tokenizer=""))
    # TEMPLATE renders lmforge's messages (calls as text) as the checkpoint's own template does, and
    # also renders TRL's ``tool_calls``; checked on one whole episode
    episode = [
        {"role": "user", "content": "12*34="},
        {"role": "assistant", "content": format_tool_calls([ToolCall("calculator", {"expression": "12*34"}, "")])},
        {"role": "tool", "content": "408"},
        {"role": "assistant", "content": "408"},
    ]
    texts = [render_messages(tok, episode, CalcGame().tools, add_generation_prompt=False)]
    tok.chat_template = TEMPLATE
    texts.append(render_messages(tok, episode, CalcGame().tools, add_generation_prompt=False))
    if texts[0] != texts[1]:
        sys.exit(
            f"--start {args.start}: its chat template renders a calculator episode otherwise than this "
            f"bench's TEMPLATE; the bench runs the char-level model of examples/sft_calculator.yaml"
        )
    tok.response_template = RESPONSE_TEMPLATE
    print(f"[bench] start: {args.start}", flush=True)
    return model, tok


# ----------------------------------------------------------------------------- alternating


def run(args) -> None:
    from transformers import TrainerCallback

    from lmforge import rl
    from lmforge.data.tasks import get_task
    from lmforge.recipes.grpo import make_step
    from lmforge.rl.sources.episodes import episode_evaluator

    print(f"[bench] load average at start: {os.getloadavg()} (2 cores, shared with other jobs)", flush=True)
    task = get_task(args.task)
    args.train_problems = task.make_problems(4096, 0, "train")
    eval_problems = task.make_problems(args.eval_games, 0, "test")
    model, tok = start_model(args)
    out = tempfile.mkdtemp(prefix="bench_env_vs_trl_")
    state, algo, cfg = lmforge_state(copy.deepcopy(model), tok, args, os.path.join(out, "lmforge"))
    evaluate = episode_evaluator(
        cfg.env, tok, eval_problems, task, [], args.episode_tokens, model.config.max_position_embeddings, 10.0, 1
    )
    lm_step = rl.synced_steps(state, make_step(state, algo))
    log = {"trl": [], "lmforge": []}  # (step, training seconds so far, episodes so far, accuracy)
    clock = {"mark": 0.0, "step": 0, "different_problems": []}
    took = {"trl": [], "lmforge": []}  # each training step's seconds (a side's training time: their sum)

    def evaluate_both(trl_model, step: int) -> None:
        for side, policy in (("trl", trl_model), ("lmforge", state.model)):
            accuracy = evaluate(policy)[0]["accuracy"]
            log[side].append((step, sum(took[side]), step * args.prompts * args.group, accuracy))
        print(
            f"[eval {step:3d}] held-out success: trl {log['trl'][-1][3]:.3f}  lmforge {log['lmforge'][-1][3]:.3f}",
            flush=True,
        )

    class Alternate(TrainerCallback):
        def on_train_begin(self, _args, _state, _control, model=None, **_):
            evaluate_both(model, 0)
            for played in PLAYED.values():
                played.clear()
            clock["mark"] = time.perf_counter()

        def on_step_end(self, _args, _state, _control, model=None, **_):
            took["trl"].append(time.perf_counter() - clock["mark"])
            clock["step"] += 1
            step = clock["step"]
            start = time.perf_counter()
            metrics = lm_step(step)
            took["lmforge"].append(time.perf_counter() - start)
            expected = set(problem_keys[(step - 1) * args.prompts : step * args.prompts])
            if not PLAYED["trl"] == PLAYED["lmforge"] == expected:
                clock["different_problems"].append(step)
            print(
                f"step {step:3d}: trl {sum(took['trl']):7.1f}s  lmforge {sum(took['lmforge']):7.1f}s  (lmforge reward "
                f"{float(metrics['reward']):.2f}, turns {float(metrics['turns_per_episode']):.1f}, policy tokens "
                f"{float(metrics['completion_len_mean']):.0f} of {float(metrics['episode_len_mean']):.0f}; gen "
                f"{float(metrics['time_generation']):.1f}s env {float(metrics['time_env']):.1f}s train "
                f"{float(metrics['time_training']):.1f}s"
                + (
                    f"; drafts {float(metrics['draft_tokens_per_episode']):.0f} an episode, "
                    f"{100 * float(metrics['draft_acceptance']):.0f}% kept"
                    if "draft_acceptance" in metrics
                    else ""
                )
                + ")",
                flush=True,
            )
            if step % args.eval_every == 0 or step == args.steps:
                evaluate_both(model, step)
            for played in PLAYED.values():
                played.clear()
            clock["mark"] = time.perf_counter()

    problems = lmforge_problems(state, args.steps)
    game = globals()[args.env].game
    problem_keys = [next(iter(game._row(p).values())) for p in problems]  # what reset() records as _played
    trainer = trl_trainer(copy.deepcopy(model), tok, args, os.path.join(out, "trl"), Alternate(), problems)
    check_same_prompt(trainer, state, args, problems[0])
    trainer.train()
    print(f"[bench] trl's last step: {trl_tool_use(trainer)}", flush=True)
    different = clock["different_problems"]
    print(
        f"[bench] the same problems on both sides at every step: {not different}"
        + (f" (not at steps {different})" if different else ""),
        flush=True,
    )
    evaluate.close()
    state.source.close()
    report(log, took, args)
    if different:  # the ratios above then compare runs on different problems: say so, and fail
        sys.exit(
            f"[result] the two sides played different problems at steps {different}: the times above do "
            f"not compare the same training problems"
        )


def report(log: dict, took: dict, args) -> None:
    print(f"[bench] load average at end: {os.getloadavg()}", flush=True)
    # Per step, beside the race: neither side has an untimed warm-up step (one would train the model), so
    # the first step's one-off costs (allocations, the first compiled shapes) count in the times to a
    # target; the median of the later steps does not carry them.
    later = {side: statistics.median(times[1:] or times) for side, times in took.items()}
    print(
        f"[result] per step: first trl {took['trl'][0]:.2f} s, lmforge {took['lmforge'][0]:.2f} s; median of "
        f"steps 2-{len(took['trl'])}: trl {later['trl']:.2f} s, lmforge {later['lmforge']:.2f} s; "
        f"trl / lmforge = {later['trl'] / later['lmforge']:.2f}",
        flush=True,
    )
    rates = {}
    for side, rows in log.items():
        step, seconds, episodes, _ = rows[-1]
        rates[side] = episodes / seconds
        print(
            f"[result] {side:8s}: {episodes} episodes in {seconds:.1f} s of training steps = "
            f"{rates[side]:.2f} episodes/s; held-out success {rows[0][3]:.3f} -> {rows[-1][3]:.3f} "
            f"(best {max(r[3] for r in rows):.3f})",
            flush=True,
        )
    print(f"[result] episodes/s lmforge / trl = {rates['lmforge'] / rates['trl']:.2f}", flush=True)
    for target in args.target:
        reached = {side: next((r for r in rows if r[3] >= target), None) for side, rows in log.items()}
        when = {side: f"{r[1]:.1f} s (step {r[0]})" if r else "not reached" for side, r in reached.items()}
        ratio = (
            f"; trl / lmforge = {reached['trl'][1] / reached['lmforge'][1]:.2f}"
            if reached["trl"] and reached["lmforge"] and reached["lmforge"][1] > 0
            else ""
        )
        print(
            f"[result] time to held-out success {target:.2f}: trl {when['trl']}, lmforge {when['lmforge']}{ratio}",
            flush=True,
        )


def trl_tool_use(trainer) -> str:
    """TRL's logged tool-call figures of its last step (how multi-turn its episodes were)."""
    last = [h for h in trainer.state.log_history if any(k.startswith("tools/") for k in h)]
    return ", ".join(f"{k} {v:.2f}" for k, v in last[-1].items() if k.startswith("tools/")) if last else "none logged"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--env",
        dest="env_name",
        choices=sorted(SETTINGS),
        default="calculator",
        help="the environment and its default settings (default calculator; module doc)",
    )
    parser.add_argument(
        "--start",
        default="runs/sft_calculator3/final",
        help="calculator: the warm checkpoint both sides start from (default "
        "runs/sft_calculator3/final, examples/sft_calculator.yaml's third run)",
    )
    parser.add_argument("--seed", type=int, default=0, help="both sides' training seed (default 0)")
    for key, kind, text in (
        ("steps", int, "GRPO steps per side"),
        ("prompts", int, "problems per step"),
        ("group", int, "episodes per problem"),
        ("turns", int, "replies per episode"),
        ("episode_tokens", int, "tokens after the first prompt"),
        ("temperature", float, "sampling temperature of both sides"),
        ("lr", float, "AdamW learning rate"),
        ("eval_every", int, "steps between held-out evaluations"),
        ("eval_games", int, "held-out problems per evaluation"),
        ("target", float, "held-out success rates to time (one or more)"),
        (
            "micro_batch",
            int,
            "rows per forward and backward on both sides (lmforge "
            "train.micro_batch_size; TRL per_device_train_batch_size, gradient_accumulation_steps "
            "making up the batch): the same update either way; 0: the whole batch in one",
        ),
        (
            "draft_tokens",
            int,
            "lmforge's env.draft_tokens (speculative decoding from n-gram "
            "drafts: the same tokens, fewer model calls; 0: off)",
        ),
    ):
        defaults = ", ".join(f"{name} {values[key]}" for name, values in SETTINGS.items())
        parser.add_argument(
            "--" + key.replace("_", "-"),
            type=kind,
            nargs="+" if key == "target" else None,
            help=f"{text} (default: {defaults})",
        )
    parser.add_argument(
        "--sft-steps", type=int, default=120, help="textarena: warm-up steps on scripted games (default 120)"
    )
    parser.add_argument(
        "--trl-micro-batch",
        type=int,
        default=None,
        help="TRL's alone, when it differs from --micro-batch (0: the whole batch)",
    )
    parser.add_argument(
        "--trl-continuous-batching",
        action="store_true",
        help="TRL generates with transformers' continuous batching (default: model.generate)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads of both sides (one process: lmforge's train.threads sets them for TRL too; default "
        "2). On a busy machine lmforge's own choice adds OMP_WAIT_POLICY=PASSIVE: set that in the environment "
        "(OpenMP reads it once, and this script imports torch first)",
    )
    parser.add_argument(
        "--hogs-per-core",
        type=int,
        default=0,
        help="run both sides under bench_busy.py's standard background load: this many spinning processes "
        "per core, started before and stopped after (default 0: the machine as it is)",
    )
    parser.add_argument("--quick", action="store_true", help="3 steps, 8 held-out games: to see it run")
    args = parser.parse_args()
    for key, value in SETTINGS[args.env_name].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    batch = args.prompts * args.group
    for name, micro in (("--micro-batch", args.micro_batch), ("--trl-micro-batch", args.trl_micro_batch)):
        if micro is not None and (micro < 0 or (micro and batch % micro)):
            parser.error(
                f"{name} {micro} must divide the batch, --prompts x --group = {batch} (or be 0: the whole batch)"
            )
    if args.quick:
        args.steps, args.eval_every, args.eval_games = 3, 3, 8
    torch.set_num_threads(args.threads)
    if not args.hogs_per_core:
        run(args)
        return
    from bench_busy import Hogs  # beside this file

    cores = len(os.sched_getaffinity(0))
    with Hogs(args.hogs_per_core * cores) as hogs:
        hogs.settle(60)
        print(f"[bench] under load: {hogs.count} spinning processes ({args.hogs_per_core} per core)", flush=True)
        run(args)


if __name__ == "__main__":
    main()
