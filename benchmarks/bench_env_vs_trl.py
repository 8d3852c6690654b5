"""Multi-turn GRPO on one environment: lmforge's episode runner vs TRL 1.16's ``GRPOTrainer(environment_factory=…)``.

What can run on both sides, and why it is not the TextArena adapter as such. TRL's environment_factory
continues an episode only through tool calls: the environment's answers are role "tool" messages, and an
episode ends at the first reply without a parsable tool call (trl/trainer/grpo_trainer.py,
``_tool_call_loop``). It has no way for an environment to answer a plain reply with a user message and go
on, which is how TextArena games are played through ``env.name=textarena`` (a move is a reply). So both
sides play the same TextArena game, GuessTheNumber-v0 (unmodified, dealt by seed through
``lmforge.envs.textarena``), behind one tool, ``move(action)``:

- TRL: ``Arena`` is the environment class (``reset(seed)`` returns the game's first observation, which
  TRL appends to the empty user message; ``move`` is its tool; ``get_reward`` the game's reward for
  player 0 when the game is over, else 0);
- lmforge: ``MoveGame`` (loaded as ``env.name=bench_env_vs_trl:MoveGame``) holds one ``Arena`` per
  episode and answers a reply as TRL's loop does: each parsed call of ``move`` is run and answered by a
  tool message with its result (or ``{'error': …}``), an unknown tool with TRL's error text, and a reply
  without a tool call ends the episode with ``get_reward``.

Same tokens on both sides: a char-level tokenizer (``char:ascii``) with one chat template (below) that
renders tools as one line, Hermes ``<tool_call>`` blocks and tool messages, prefix-preserving, with a
``response_template`` so that TRL can parse the calls. The script checks that TRL's prompt ids equal
lmforge's. Both start from the same warm model: a tiny random Llama (char tokens), trained here for
``--sft-steps`` on scripted games (a bisecting player's tool calls), so that the policy calls the tool
at all; it is stopped early on purpose, so that GRPO has something to improve.

Same algorithm settings: group-normalised advantages, ``--prompts`` games x ``--group`` episodes per
step, temperature ``--temperature`` (0.5: at 1 the warm model's sampled tool calls nearly always break,
so every episode is one reply), no top-k / top-p, clip 0.2 / 0.2, no KL (TRL ``beta=0``), one iteration
and one mini-batch, per-episode token mean then mean over episodes (lmforge ``seq_mean_token_mean``, TRL
``loss_type="grpo"``; lmforge keeps zero-advantage episodes in the mean, as TRL does), AdamW at
``--lr`` constant, betas (0.9, 0.999), no weight decay, grad-norm clip 1.0, fp32, one micro-batch.
Episode limits: ``--episode-tokens`` tokens after the first prompt (lmforge ``env.max_episode_tokens`` =
TRL ``max_completion_length``; a reply may use what is left of it: lmforge ``rollout.max_new_tokens`` =
the same number), ``--turns`` replies (lmforge ``env.max_turns``; TRL ``max_tool_calling_iterations`` =
turns - 1). Not the same: the games each side draws per step (TRL's sampler order vs lmforge's), and the
advantage's std epsilon (1e-6 lmforge, 1e-4 TRL).

Timing: TRL drives (``trainer.train()``); at each of its ``on_step_end`` one lmforge step runs, so the
two alternate and share the machine's load. TRL's step time is the wall time between two
``on_step_end`` calls minus lmforge's step and the evaluations. Every ``--eval-every`` steps both models
play the same ``--eval-games`` held-out games (seeds no training game uses) greedily through lmforge's
evaluator (``rl.sources.episodes.episode_evaluator``, the same code for both, not timed); a success is a
won game. Printed: episodes per second of training steps for each side, their ratio, and for each side
the training time until the held-out success rate first reached ``--target`` (or "not reached").

    python benchmarks/bench_env_vs_trl.py                 # 30 steps each
    python benchmarks/bench_env_vs_trl.py --quick         # a few steps, to see it run
"""
from __future__ import annotations

import argparse
import copy
import os
import random
import sys
import tempfile
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # env.name=bench_env_vs_trl:MoveGame

GAME = "GuessTheNumber-v0"
TEMPLATE = (
    "{% if tools %}{{ '<|system|>\n' }}{% for tool in tools %}{% set fn = tool.get('function', tool) %}"
    "{{ fn['name'] + '(' + (fn.get('parameters', {}).get('properties', {}) | join(', ')) + ')' }}"
    "{% if not loop.last %}{{ ' ' }}{% endif %}{% endfor %}{{ eos_token + '\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + (message['content'] or '') }}"
    "{% for call in message.get('tool_calls') or [] %}{% set fn = call.get('function', call) %}"
    "{{ '<tool_call>\n' + {'name': fn['name'], 'arguments': fn['arguments']} | tojson + '\n</tool_call>' }}"
    "{% endfor %}{{ eos_token + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
RESPONSE_TEMPLATE = {"defaults": {"role": "assistant"}, "start_anchor": "<|assistant|>\n", "fields": {
    "tool_calls": {"open": "<tool_call>", "close_pattern": "</tool_call>\\s*", "repeats": True, "content": "json",
                   "transform": {"type": "function", "function": "{content}"}},
    "content": {"close_pattern": "<eos>\\s*", "content": "text"}}}
_GAMES: dict = {}  # the one TextArenaGame (lmforge.envs.textarena), built on first use


def textarena_game():
    if "game" not in _GAMES:
        from lmforge.envs.textarena import TextArenaGame

        _GAMES["game"] = TextArenaGame(GAME)
    return _GAMES["game"]


class Arena:
    """One game behind the tool ``move``: TRL's environment class (module doc)."""

    def reset(self, seed, **_) -> str:
        from lmforge.envs.base import EpisodeState

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

    def get_reward(self) -> float:
        return self._reward


class MoveGame:
    """lmforge's side: an ``Arena`` per episode, replies answered as TRL's tool loop answers them."""

    def __init__(self):
        from lmforge.envs.toolcalls import function_schema

        self.tools = [function_schema(Arena().move)]

    def reset(self, problem, state):
        state.info["arena"] = Arena()
        return [{"role": "user", "content": state.info["arena"].reset(seed=int(problem.answer))}]

    def step(self, state, message):
        from lmforge.envs.base import StepResult
        from lmforge.envs.toolcalls import parse_tool_calls

        arena, calls = state.info["arena"], parse_tool_calls(message["content"]).calls
        if not calls:
            return StepResult([], {"game": arena.get_reward()}, done=True)
        replies = []
        for call in calls:
            state.counts["tool_calls"] = state.counts.get("tool_calls", 0) + 1
            try:
                if call.name != "move":
                    raise ValueError(f"Tool {call.name} not found.")
                result = arena.move(**call.arguments)
            except Exception as exc:  # noqa: BLE001 -- as TRL: the error goes back to the model
                result = {"error": str(exc)}
            replies.append({"role": "tool", "name": call.name, "content": str(result)})
        return StepResult(replies, {}, done=False)


# ----------------------------------------------------------------------------- the warm start

def bench_model(seed: int = 0):
    from lmforge.config import ModelConfig
    from lmforge.models import load_model

    torch.manual_seed(seed)
    model, tok = load_model(ModelConfig(name="tiny:llama", tokenizer="char:ascii", hidden_size=64, num_layers=2,
                                        num_heads=4, max_position_embeddings=2048))
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
        new = tok(before, add_special_tokens=False)["input_ids"][len(ids):]
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
    print(f"[bench] warm-up: {steps} steps on {len(demos)} scripted games, last loss {loss.item():.3f} "
          f"({time.perf_counter() - start:.0f} s)", flush=True)
    return time.perf_counter() - start


# ----------------------------------------------------------------------------- the two trainers

def lmforge_state(model, tok, args, out_dir: str):
    """The state ``run_grpo`` builds (``rl.prepare``) with the environment and the settings of the module doc."""
    from lmforge import rl
    from lmforge.config import load_config
    from lmforge.recipes.grpo import GRPOConfig

    cfg = load_config(GRPOConfig, None, [
        "data.task=seeds", "data.num_train=4096", "data.num_eval=0", "data.use_chat_template='on'",
        "env.name=bench_env_vs_trl:MoveGame", f"env.max_turns={args.turns}",
        f"env.max_episode_tokens={args.episode_tokens}", "env.max_invalid_calls=0", "env.workers=2",
        f"rollout.num_prompts={args.prompts}", f"rollout.group_size={args.group}",
        f"rollout.temperature={args.temperature}",
        "rollout.top_k=0", "rollout.top_p=1.0", f"rollout.max_new_tokens={args.episode_tokens}",
        "rewards.functions=[]", "algo.advantage=group_norm", "algo.loss_type=token_clip",
        "algo.aggregation=seq_mean_token_mean", "algo.skip_zero_advantage=false", "algo.eps_low=0.2",
        "algo.eps_high=0.2", "algo.kl_coef=0.0", "algo.entropy_coef=0.0", "algo.num_iterations=1",
        "algo.num_mini_batches=1", f"optim.lr={args.lr}", "optim.schedule=constant", "optim.warmup_steps=0",
        "optim.weight_decay=0.0", "optim.beta1=0.9", "optim.beta2=0.999", "optim.eps=1e-8",
        "optim.max_grad_norm=1.0", f"train.micro_batch_size={args.prompts * args.group}",
        "train.gradient_checkpointing='off'", "train.dtype=fp32", "train.device=cpu",
        f"train.max_steps={args.steps}", f"train.output_dir={out_dir}", "train.save_every=0",
        "train.eval_every=0", "logging.progress=false", "train.threads=2"])
    algo = cfg.algo.resolved()
    return rl.prepare(cfg, "bench_env_vs_trl", algo, model=model, tokenizer=tok), algo, cfg


def trl_trainer(model, tok, args, out_dir: str, callback, train_seeds: list[int]):
    from datasets import Dataset
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig as TRLConfig, GRPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    hf_logging.set_verbosity_error()
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": ""}], "seed": s} for s in train_seeds])
    config = TRLConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=args.prompts * args.group, gradient_accumulation_steps=1,
        num_generations=args.group, max_completion_length=args.episode_tokens,
        max_tool_calling_iterations=args.turns - 1, temperature=args.temperature, top_p=1.0, top_k=0, beta=0.0,
        num_iterations=1, epsilon=0.2, loss_type="grpo", scale_rewards="group", learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, max_grad_norm=1.0, max_steps=args.steps, logging_steps=1, save_strategy="no",
        report_to="none", dataloader_num_workers=0, disable_tqdm=True, seed=0, log_completions=False)
    return GRPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tok,
                       environment_factory=Arena, callbacks=[callback])


def check_same_prompt(trainer, state, seed: int) -> None:
    """TRL's first prompt ids for a game equal lmforge's (same template, tools, observation)."""
    from lmforge.envs.base import EpisodeState
    from lmforge.envs.toolcalls import render_messages

    env, episode = MoveGame(), EpisodeState(types.SimpleNamespace(answer=str(seed)))
    text = render_messages(state.tokenizer, env.reset(episode.problem, episode), env.tools, add_generation_prompt=True)
    ours = state.tokenizer(text, add_special_tokens=False)["input_ids"]
    arena = Arena()
    prompt = [{"role": "user", "content": arena.reset(seed=seed)}]
    theirs = trainer.processing_class.apply_chat_template(prompt, tools=[arena.move], add_generation_prompt=True,
                                                          tokenize=True, return_dict=False)
    print(f"[bench] first-prompt token ids identical on both sides: {list(theirs) == list(ours)} "
          f"({len(ours)} tokens)", flush=True)


# ----------------------------------------------------------------------------- alternating

def run(args) -> None:
    from transformers import TrainerCallback

    from lmforge import rl
    from lmforge.data.tasks import get_task
    from lmforge.recipes.grpo import grpo_step
    from lmforge.rl.sources.episodes import episode_evaluator

    print(f"[bench] load average at start: {os.getloadavg()} (2 cores, shared with other jobs)", flush=True)
    task = get_task("seeds")
    train_seeds = [int(p.answer) for p in task.make_problems(4096, 0, "train")]
    eval_problems = task.make_problems(args.eval_games, 0, "test")
    model, tok = bench_model()
    warm_up(model, tok, train_seeds[:256], args.sft_steps)
    out = tempfile.mkdtemp(prefix="bench_env_vs_trl_")
    state, algo, cfg = lmforge_state(copy.deepcopy(model), tok, args, os.path.join(out, "lmforge"))
    evaluate = episode_evaluator(cfg.env, tok, eval_problems, task, [], args.episode_tokens, 2048, 10.0, 1)
    lm_step = rl.synced_steps(state, lambda done: grpo_step(state, algo, done))
    log = {"trl": [], "lmforge": []}  # (step, training seconds so far, episodes so far, accuracy)
    clock = {"trl": 0.0, "lmforge": 0.0, "mark": 0.0, "step": 0}

    def evaluate_both(trl_model, step: int) -> None:
        for side, policy in (("trl", trl_model), ("lmforge", state.model)):
            accuracy = evaluate(policy)[0]["accuracy"]
            log[side].append((step, clock[side], step * args.prompts * args.group, accuracy))
        print(f"[eval {step:3d}] held-out wins: trl {log['trl'][-1][3]:.2f}  lmforge {log['lmforge'][-1][3]:.2f}",
              flush=True)

    class Alternate(TrainerCallback):
        def on_train_begin(self, _args, _state, _control, model=None, **_):
            evaluate_both(model, 0)
            clock["mark"] = time.perf_counter()

        def on_step_end(self, _args, _state, _control, model=None, **_):
            clock["trl"] += time.perf_counter() - clock["mark"]
            clock["step"] += 1
            step = clock["step"]
            start = time.perf_counter()
            metrics = lm_step(step)
            clock["lmforge"] += time.perf_counter() - start
            print(f"step {step:3d}: trl {clock['trl']:7.1f}s  lmforge {clock['lmforge']:7.1f}s  (lmforge reward "
                  f"{float(metrics['reward']):.2f}, turns {float(metrics['turns_per_episode']):.1f}, policy tokens "
                  f"{float(metrics['completion_len_mean']):.0f} of {float(metrics['episode_len_mean']):.0f}; gen "
                  f"{float(metrics['time_generation']):.1f}s env {float(metrics['time_env']):.1f}s train "
                  f"{float(metrics['time_training']):.1f}s)", flush=True)
            if step % args.eval_every == 0 or step == args.steps:
                evaluate_both(model, step)
            clock["mark"] = time.perf_counter()

    trainer = trl_trainer(copy.deepcopy(model), tok, args, os.path.join(out, "trl"), Alternate(), train_seeds)
    check_same_prompt(trainer, state, train_seeds[0])
    trainer.train()
    print(f"[bench] trl's last step: {trl_tool_use(trainer)}", flush=True)
    evaluate.close()
    state.source.close()
    report(log, args)


def report(log: dict, args) -> None:
    print(f"[bench] load average at end: {os.getloadavg()}", flush=True)
    rates = {}
    for side, rows in log.items():
        step, seconds, episodes, _ = rows[-1]
        rates[side] = episodes / seconds
        reached = next((r for r in rows if r[3] >= args.target), None)
        when = f"{reached[1]:.1f} s (step {reached[0]})" if reached else "not reached"
        print(f"[result] {side:8s}: {episodes} episodes in {seconds:.1f} s of training steps = "
              f"{rates[side]:.2f} episodes/s; held-out wins {rows[0][3]:.2f} -> {rows[-1][3]:.2f}; "
              f"time to {args.target:.2f}: {when}", flush=True)
    print(f"[result] episodes/s lmforge / trl = {rates['lmforge'] / rates['trl']:.2f}", flush=True)


def trl_tool_use(trainer) -> str:
    """TRL's logged tool-call figures of its last step (how multi-turn its episodes were)."""
    last = [h for h in trainer.state.log_history if any(k.startswith("tools/") for k in h)]
    return ", ".join(f"{k} {v:.2f}" for k, v in last[-1].items() if k.startswith("tools/")) if last else "none logged"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="GRPO steps per side (default 30)")
    parser.add_argument("--prompts", type=int, default=2, help="games per step (default 2)")
    parser.add_argument("--group", type=int, default=4, help="episodes per game (default 4)")
    parser.add_argument("--turns", type=int, default=8, help="replies per episode (default 8)")
    parser.add_argument("--episode-tokens", type=int, default=400, help="tokens after the first prompt (default 400)")
    parser.add_argument("--temperature", type=float, default=0.5,
                        help="sampling temperature of both sides (default 0.5)")
    parser.add_argument("--lr", type=float, default=1e-4,
                        help="AdamW learning rate (default 1e-4: at 1e-3 both policies broke within 3 steps)")
    parser.add_argument("--sft-steps", type=int, default=120, help="warm-up steps on scripted games (default 120)")
    parser.add_argument("--eval-every", type=int, default=10, help="steps between held-out evaluations (default 10)")
    parser.add_argument("--eval-games", type=int, default=32, help="held-out games per evaluation (default 32)")
    parser.add_argument("--target", type=float, default=0.5, help="held-out win rate to time (default 0.5)")
    parser.add_argument("--quick", action="store_true", help="3 steps, 8 held-out games: to see it run")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.eval_every, args.eval_games = 3, 3, 8
    torch.set_num_threads(2)
    run(args)


if __name__ == "__main__":
    main()
