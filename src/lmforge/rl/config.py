"""Config sections shared by the RL recipes (``grpo``, ``ppo``) and how algorithm keys resolve:
explicit key > the loss's own clip range > preset > default. The lowest file of the RL package: each
component above takes the one section it needs (a source the rollout section, the update the algo
section), resolved here once."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from ..core.config import opt, refuse_ignored
from ..core.errors import ConfigError
from ..data.prompts import COLUMN_NAMES as PROMPT_COLUMNS
from ..data.tasks import check_task_section
from ..envs.episode import EpisodeLimits
from ..envs.registry import check_environment
from ..losses.advantages import ADVANTAGES
from ..losses.policy import (
    AGGREGATIONS,
    GSPO_EPS_HIGH,
    GSPO_EPS_LOW,
    IS_LEVELS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PolicyLossSpec,
)
from ..rollout import SamplingParams


@dataclasses.dataclass
class RolloutConfig:
    num_prompts: int = opt(8, "prompts sampled per RL step")
    group_size: int = opt(8, "completions sampled per prompt (G)")
    temperature: float = opt(1.0, "sampling temperature (> 0); training logprobs use logits / temperature too")
    top_k: int = opt(0, "sample among the k most likely tokens only (0 = off; see docs/rl-recipes.md)")
    top_p: float = opt(1.0, "nucleus sampling mass (1 = off; see docs/rl-recipes.md)")
    max_new_tokens: int = opt(64, "longest completion; also the Dr. GRPO length normaliser")
    backend: str = opt(
        "inprocess",
        "rollout source (lmforge.rl.sources.SOURCES): inprocess (any device), vllm (one CUDA GPU, "
        "unverified here; docs/vllm.md), atropos (scored batches pulled from an Atropos API server; "
        "docs/atropos.md), verifiers (episodes of a verifiers environment; docs/verifiers.md) or agent (an "
        "unmodified agent program against the served policy; docs/agents.md)",
    )
    vllm_gpu_memory_utilization: float = opt(
        0.3, "vllm backend: fraction of GPU memory vLLM reserves (its weights + KV cache)", free_on_resume=True
    )
    dtype: Literal["same", "bf16", "fp16"] = opt(
        "same",
        "inprocess backend: weights the sampler decodes with: same (the policy itself) or a bf16 / fp16 "
        "copy synced before each rollout (faster decoding where that dtype is fast; see docs/rl-recipes.md)",
    )
    async_steps: int = opt(
        0,
        "take the batch of step k + N from the source in a background thread while step k "
        "trains (0 = off; any backend, one process; needs algo.is_level; docs/rl-recipes.md, "
        "overlapped rollouts)",
    )
    async_threads: int = opt(
        0,
        "async on CPU: intra-op threads (per process) while sampler and trainer run side by "
        "side (0 = half of train.threads)",
        free_on_resume=True,
    )

    # rollout.backend=atropos (docs/atropos.md): where batches come from and where new weights go
    api_url: str = opt(
        "", "atropos backend: the Atropos API server (run-api), e.g. http://127.0.0.1:8000", free_on_resume=True
    )
    server_url: str = opt(
        "",
        "atropos backend: the lmforge serve the environments sample from; new weights are "
        "pushed there every push_every steps ('' = never push)",
        free_on_resume=True,
    )
    push_every: int = opt(1, "atropos backend: push the weights to server_url after every N-th step")
    push_timeout_s: float = opt(
        600.0,
        "atropos backend: longest a weight push may take, retries included; then "
        "an error naming server_url (the last checkpoint resumes)",
        free_on_resume=True,
    )
    max_staleness: int = opt(
        -1,
        "atropos backend: drop groups sampled more than this many optimizer steps ago "
        "(counted in atropos_dropped_stale_*; -1 = keep all)",
    )
    api_timeout_s: float = opt(
        600.0, "atropos backend: longest wait for a step's groups, then an error", free_on_resume=True
    )
    api_poll_s: float = opt(
        1.0, "atropos backend: pause between GET /batch polls while no batch is ready", free_on_resume=True
    )
    api_retries: int = opt(
        5, "atropos backend: retries of a failed call (connection error, 5xx) before an error", free_on_resume=True
    )
    api_backoff_s: float = opt(
        1.0, "atropos backend: the first retry waits this long, each next one twice as long", free_on_resume=True
    )

    # rollout.backend=verifiers (docs/verifiers.md): episodes of a verifiers v1 environment on the served policy
    verifiers_env: str = opt(
        "",
        "verifiers backend: the environment's taskset id (an importable module, e.g. "
        "vf-calculate for examples/vf_calculate.py on PYTHONPATH)",
    )
    verifiers_args: dict[str, Any] = opt({}, "verifiers backend: the taskset's config fields, e.g. {num_tasks: 500}")
    verifiers_harness: str = opt(
        "null",
        "verifiers backend: the harness that plays each episode (null: verifiers' chat loop with the taskset's tools)",
    )
    verifiers_timeout_s: float = opt(
        3600.0,
        "verifiers backend: longest wait for one step's episodes, then an error (the last checkpoint resumes)",
        free_on_resume=True,
    )
    verifiers_renderer: dict[str, Any] = opt(
        {},
        "verifiers backend: the renderers config verifiers tokenizes with "
        "({} = lmforge's own rendering and tool-call parsing, as lmforge serve "
        "does: rl/sources/vf_renderer.py; e.g. {name: qwen3} for a model "
        "renderers knows)",
    )

    # rollout.backend=agent (docs/agents.md): an agent program run per episode against the served policy
    agent_entry: str = opt(
        "",
        "agent backend: the agent, 'package.module:function' or 'path/file.py:function', "
        "called per episode as function(base_url, problem) (plain or async); it returns the "
        "reward (a number, a dict of named parts, or its final text for rewards.functions)",
    )
    agent_args: dict[str, Any] = opt({}, "agent backend: more keyword arguments for the agent function")
    agent_concurrency: int = opt(
        0, "agent backend: episodes run at once (0 = all of a step's: their calls share the server's continuous batch)"
    )
    agent_timeout_s: float = opt(
        300.0,
        "agent backend: wall clock per episode; then its session ends and it "
        "counts in num_agent_timeouts with reward 0",
    )

    def validate(self) -> None:
        if self.backend == "agent":
            if ":" not in self.agent_entry:
                raise ConfigError(
                    f"rollout.backend=agent needs rollout.agent_entry='package.module:function' or "
                    f"'path/file.py:function' (the agent to run per episode), got "
                    f"{self.agent_entry!r}"
                )
            if self.agent_concurrency < 0 or not self.agent_timeout_s > 0:
                raise ConfigError(
                    f"rollout: need agent_concurrency >= 0 and agent_timeout_s > 0, got "
                    f"{self.agent_concurrency}, {self.agent_timeout_s}"
                )
        elif self.agent_entry or self.agent_args:
            raise ConfigError(
                f"rollout.agent_entry / rollout.agent_args apply to rollout.backend=agent; this run's "
                f"backend is {self.backend} (set rollout.backend=agent, or drop them)"
            )
        if self.backend == "atropos":
            if not self.api_url:
                raise ConfigError(
                    "rollout.backend=atropos needs rollout.api_url (the Atropos API server, e.g. http://127.0.0.1:8000)"
                )
            if (
                self.push_every < 1
                or self.api_retries < 0
                or not (
                    self.api_timeout_s > 0
                    and self.api_poll_s > 0
                    and self.api_backoff_s >= 0
                    and self.push_timeout_s > 0
                )
            ):
                raise ConfigError(
                    "rollout: need push_every >= 1, api_retries >= 0, api_timeout_s > 0, api_poll_s > 0, "
                    f"api_backoff_s >= 0 and push_timeout_s > 0, got {self.push_every}, "
                    f"{self.api_retries}, {self.api_timeout_s}, {self.api_poll_s}, {self.api_backoff_s}, "
                    f"{self.push_timeout_s}"
                )
        if self.backend == "verifiers" and not self.verifiers_env:
            raise ConfigError(
                "rollout.backend=verifiers needs rollout.verifiers_env (a verifiers taskset id, e.g. "
                "vf-calculate with examples/ on PYTHONPATH)"
            )
        if self.backend == "verifiers" and not self.verifiers_timeout_s > 0:
            raise ConfigError(f"rollout.verifiers_timeout_s must be > 0, got {self.verifiers_timeout_s}")
        for name in ("num_prompts", "group_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if not self.temperature > 0:
            raise ConfigError(
                f"rollout.temperature must be > 0, got {self.temperature}: RL trains on "
                "sampled completions (greedy decoding has no distribution to improve)"
            )
        if self.async_steps < 0 or self.async_threads < 0:
            raise ConfigError(
                f"rollout.async_steps and rollout.async_threads must be >= 0, got {self.async_steps}, "
                f"{self.async_threads}"
            )
        if not 0 < self.vllm_gpu_memory_utilization < 1:
            raise ConfigError(
                f"rollout.vllm_gpu_memory_utilization must be in (0, 1), got {self.vllm_gpu_memory_utilization}"
            )
        if self.dtype != "same" and self.backend != "inprocess":
            raise ConfigError(
                f"rollout.dtype={self.dtype} applies to the inprocess backend; the {self.backend} "
                "backend keeps its own weights (set rollout.dtype=same)"
            )
        try:
            self.sampling(stop_token_ids=[], seed=0)
        except ValueError as exc:
            raise ConfigError(f"rollout: {exc}") from exc

    @property
    def truncates(self) -> bool:
        """Whether top-k / top-p make the sampling distribution differ from softmax(logits / T)."""
        return self.top_k > 0 or self.top_p < 1.0

    def sampling(self, stop_token_ids: list[int], seed: int) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=stop_token_ids,
            seed=seed,
        )


@dataclasses.dataclass
class RewardsConfig:
    functions: list[Any] = opt(
        ["exact"],
        "reward functions, summed with weights: each a name (exact, math, format, "
        "overlong, package.module:function) or {name, weight, kwargs, executor, failure_value} "
        "(other keys go to kwargs); docs/rewards.md",
    )
    max_failure_fraction: float = opt(
        0.5,
        "stop the run when a reward function fails on more than this "
        "fraction of a batch (fewer failures score failure_value and are counted)",
        free_on_resume=True,
    )
    timeout_s: float = opt(
        10.0,
        "longest a single reward call may run; a slower one is a counted failure "
        "(0 = no timeout: calls run one by one in the training process)",
    )
    workers: int = opt(
        0, "reward threads, and processes for executor=process functions (0 = cores, at most 8)", free_on_resume=True
    )

    def specs(self, allow_empty: bool = False) -> list[tuple]:
        """``RewardSet`` specs ``(name, weight, kwargs, options)`` from ``functions`` (an environment run
        may have none: ``allow_empty``, its episodes are scored by the environment alone)."""
        if not self.functions and not allow_empty:
            raise ConfigError(
                "rewards.functions is empty; name at least one reward, e.g. [exact] (an env run "
                "may set [] to use the environment's reward alone, an agent run to use the numbers "
                "its agent returns)"
            )
        specs = []
        for i, item in enumerate(self.functions):
            if isinstance(item, str):
                item = {"name": item}
            if not isinstance(item, dict) or "name" not in item:
                raise ConfigError(
                    f"rewards.functions[{i}] = {item!r}: expected a name or a mapping with "
                    "'name' and optional 'weight', 'kwargs', 'executor', 'failure_value'"
                )
            try:
                weight = float(item.get("weight", 1.0))
            except (TypeError, ValueError):
                raise ConfigError(f"rewards.functions[{i}].weight must be a number, got {item['weight']!r}") from None
            kwargs = item.get("kwargs") or {}
            if not isinstance(kwargs, dict):
                raise ConfigError(f"rewards.functions[{i}].kwargs must be a mapping, got {kwargs!r}")
            flat = {k: v for k, v in item.items() if k not in ("name", "weight", "kwargs", "executor", "failure_value")}
            options = {k: item[k] for k in ("executor", "failure_value") if k in item}
            specs.append((str(item["name"]), weight, {**flat, **kwargs}, options))
        return specs

    def validate(self, allow_empty: bool = True) -> None:
        """(At load, an empty list passes: whether the run has an environment is known in check_rl_config.)"""
        self.specs(allow_empty)
        if not 0.0 <= self.max_failure_fraction <= 1.0:
            raise ConfigError(f"rewards.max_failure_fraction must be in [0, 1], got {self.max_failure_fraction}")
        if self.timeout_s < 0:
            raise ConfigError(f"rewards.timeout_s must be >= 0 (0 = no timeout), got {self.timeout_s}")
        if self.workers < 0:
            raise ConfigError(f"rewards.workers must be >= 0 (0 = automatic), got {self.workers}")


@dataclasses.dataclass
class RLDataConfig:
    task: str = opt(
        "",
        "task giving prompts, the 'exact' reward and held-out accuracy: a built-in one (e.g. "
        "addition) or a reasoning-gym dataset, rg:<name>[:key=value,...] (docs/rewards.md)",
    )
    path: str = opt(
        "",
        "instead of a task: rows with a 'prompt' (each row goes to the reward functions): JSONL, "
        "Parquet, CSV, Arrow, a save_to_disk dir or a cached hub id (docs/data.md)",
    )
    split: str = opt("train", "path: the split to train on (a single file is split 'train')")
    eval_split: str = opt("", "path: a named split for held-out evaluation instead of data.eval_fraction")
    eval_fraction: float = opt(
        0.1,
        "path: fraction of rows held out for evaluation when they have an 'answer' "
        "(seeded by train.seed; at most data.num_eval)",
    )
    subset: str = opt("", "path: the hub dataset's config name (e.g. main)")
    columns: dict[str, str] = opt(
        {}, "path: lmforge name -> the data's column, e.g. {prompt: question, answer: answer}", keys=PROMPT_COLUMNS
    )
    num_train: int = opt(4000, "task: training prompts")
    num_eval: int = opt(
        200,
        "held-out problems for greedy accuracy (task: generated; path: at most this many) (0 = none)",
        free_on_resume="unless_path",
    )
    pass_k: int = opt(
        0, "also held-out pass@k: k completions per problem at rollout.temperature (0 = off)", free_on_resume=True
    )
    use_chat_template: Literal["auto", "on", "off"] = opt(
        "auto", "wrap prompts in the chat template (auto: when the tokenizer has its own)"
    )
    max_prompt_len: int = opt(0, "longest prompt in tokens (0 = the model's context minus rollout.max_new_tokens)")
    prompt_truncation: Literal["drop", "left"] = opt(
        "drop", "longer prompts: drop them, or keep their last max_prompt_len tokens; counted either way"
    )

    def validate(self) -> None:
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.pass_k < 0:
            raise ConfigError(f"data.pass_k must be >= 0 (0 = off), got {self.pass_k}")
        if self.max_prompt_len < 0:
            raise ConfigError(f"data.max_prompt_len must be >= 0 (0 = automatic), got {self.max_prompt_len}")
        if bool(self.path) == bool(self.task):
            raise ConfigError("set exactly one of data.task (e.g. addition) and data.path (prompt rows: docs/data.md)")
        if self.task:
            check_task_section(self, ("split", "eval_split", "eval_fraction", "subset", "columns"))


@dataclasses.dataclass
class EnvConfig:
    name: str = opt(
        "",
        "multi-turn environment: a built-in name (lmforge.envs.registry) or package.module:Class "
        "('' = single-turn completions); its reset() turns each data.task problem into the first "
        "messages (docs/environments.md)",
    )
    args: dict[str, Any] = opt({}, "keyword arguments for the environment's class")
    max_turns: int = opt(8, "assistant turns per episode; the episode ends there (counted: num_truncated_turns)")
    max_episode_tokens: int = opt(
        256,
        "tokens an episode adds after its first prompt (the policy's turns and the "
        "environment's messages); a turn that would pass it is cut and the episode ends "
        "(num_truncated_episode_tokens); the default leaves half of a default tiny "
        "model's 512-token context (model.max_position_embeddings) to the first prompt",
    )
    max_tool_result_tokens: int = opt(
        256, "a tool message longer than this is cut to it (num_tool_results_cut; 0 = no limit)"
    )
    tool_timeout_s: float = opt(
        10.0,
        "longest an environment call (reset, or step with its tool calls) may run; "
        "a slower one ends its episode (tool_timeouts; 0 = no limit)",
    )
    max_invalid_calls: int = opt(
        3,
        "invalid tool calls (bad JSON, unknown tool, wrong arguments) that end an "
        "episode (num_truncated_invalid_calls; 0 = no limit)",
    )
    workers: int = opt(0, "threads calling the environment in parallel (0 = the cores, at most 8)")
    continuous: bool = opt(
        True,
        "continuous batching across turns: an episode's next turn joins the running batch "
        "as soon as its environment step returns, with its KV cache kept (only the new tokens "
        "prefilled), and each turn samples from its own seed; false = rounds: every turn of "
        "every episode waits for the slowest; models with sliding-window caches always run in rounds "
        "(docs/environments.md, Rollouts)",
    )
    draft_tokens: int = opt(
        0,
        "continuous batching: speculative decoding -- each row may check up to this many "
        "drafted tokens per model call, proposed from token n-grams of earlier episodes and "
        "kept or rejected so that every token is drawn from the policy's own distribution "
        "(0 = off; docs/environments.md, Rollouts)",
    )

    def validate(self) -> None:
        if not self.name:
            refuse_ignored(
                self,
                "env",
                tuple(f.name for f in dataclasses.fields(self) if f.name != "name"),
                "without env.name (they configure a multi-turn environment)",
            )
            return
        for key in ("max_turns", "max_episode_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(f"env.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("max_tool_result_tokens", "max_invalid_calls", "workers", "draft_tokens"):
            if getattr(self, key) < 0:
                meaning = {"workers": "automatic", "draft_tokens": "off"}.get(key, "no limit")
                raise ConfigError(f"env.{key} must be >= 0 (0 = {meaning}), got {getattr(self, key)}")
        if self.draft_tokens and not self.continuous:
            raise ConfigError(
                f"env.draft_tokens={self.draft_tokens} drafts tokens inside continuous batching; with "
                "env.continuous=false nothing would use it (set env.continuous=true or "
                "env.draft_tokens=0)"
            )
        if not self.tool_timeout_s >= 0:
            raise ConfigError(f"env.tool_timeout_s must be >= 0 (0 = no limit), got {self.tool_timeout_s}")
        if not isinstance(self.args, dict):
            raise ConfigError(f"env.args must be a mapping of keyword arguments, got {self.args!r}")
        check_environment(self.name, self.args)  # unknown name, no reset / step, wrong args: ConfigError now

    def limits(self) -> EpisodeLimits:
        return EpisodeLimits(
            max_turns=self.max_turns,
            max_episode_tokens=self.max_episode_tokens,
            max_tool_result_tokens=self.max_tool_result_tokens,
            timeout_s=self.tool_timeout_s,
            max_invalid_calls=self.max_invalid_calls,
        )


def check_env(env: EnvConfig | None, cfg) -> None:
    """ConfigError for settings an environment run cannot take (called with the other cross-section checks)."""
    if env is None or not env.name:
        return
    if cfg.rollout.backend != "inprocess":
        raise ConfigError(
            f"env.name={env.name!r} runs episodes on the inprocess sampler; rollout.backend="
            f"{cfg.rollout.backend} is not supported with an environment (set rollout.backend=inprocess)"
        )
    if not cfg.data.task:
        raise ConfigError(
            f"env.name={env.name!r} takes its problems from data.task (the environment's reset turns "
            "each into messages; held-out problems come from the same task); set data.task"
        )
    if cfg.data.use_chat_template == "off":
        raise ConfigError(
            "data.use_chat_template=off: an environment's conversation is rendered through the chat "
            "template; set it to auto or on"
        )


# The algorithm keys both recipes share. Keys that a preset may set default to None ("unset") so
# that an explicit value can be told apart from a default: explicit > loss clip > preset > default.
POLICY_DEFAULTS = {
    "loss_type": "token_clip",
    "aggregation": "seq_mean_token_mean",
    "eps_low": 0.2,
    "eps_high": 0.2,
    "kl_coef": 0.0,
}
# Clip ranges that belong to the loss, not to a preset: GSPO clips a length-normalised sequence
# ratio, which moves ~1e-3 per update, so PPO's 0.2 would never clip (GSPO paper values).
LOSS_CLIP_DEFAULTS = {"gspo": (GSPO_EPS_LOW, GSPO_EPS_HIGH), "gspo_token": (GSPO_EPS_LOW, GSPO_EPS_HIGH)}
NAMED_CHOICES = {
    "loss_type": POLICY_LOSSES,
    "aggregation": AGGREGATIONS,
    "advantage": ADVANTAGES,
    "kl_estimator": KL_ESTIMATORS,
    "is_level": {"none": None, **IS_LEVELS},
}


@dataclasses.dataclass
class PolicyConfig:
    loss_type: str | None = opt(None, f"policy loss: {', '.join(POLICY_LOSSES)} (unset: preset, else token_clip)")
    aggregation: str | None = opt(
        None, f"per-token -> scalar: {', '.join(AGGREGATIONS)} (unset: preset, else seq_mean_token_mean)"
    )
    eps_low: float | None = opt(None, "ratio clip below 1 - eps_low (unset: 3e-4 for gspo*, else preset, else 0.2)")
    eps_high: float | None = opt(None, "ratio clip above 1 + eps_high (unset: 4e-4 for gspo*, else preset, else 0.2)")
    dual_clip: float | None = opt(
        None, "dual-clip constant c > 1 bounding the loss of negative advantages (null = off)"
    )
    kl_coef: float | None = opt(
        None, "KL weight to the reference = the starting policy, loaded only when > 0 (unset: preset, else 0)"
    )
    kl_estimator: str = opt("k3", "KL estimator: k1, k2, k3")
    entropy_coef: float = opt(0.0, "entropy bonus weight (entropy is logged either way)")
    num_iterations: int = opt(1, "optimizer passes over each rollout batch")
    num_mini_batches: int = opt(1, "optimizer updates per pass (the batch is split into this many)")
    is_level: str = opt("none", "importance weights pi_old / pi_rollout against the sampler: none, token, sequence")
    is_cap: float = opt(2.0, "truncate importance weights at this value")

    def resolved(self) -> "PolicyConfig":
        return resolve_algo(self, POLICY_DEFAULTS)

    def validate(self) -> None:
        self.resolved()


def resolve_algo(algo, defaults: dict, preset_values: dict | None = None):
    """A copy of ``algo`` with every unset (None) key of ``defaults`` filled, then checked.

    Precedence: explicit value > the loss type's own clip range (GSPO) > preset > default.
    """
    explicit = {key: getattr(algo, key) for key in defaults if getattr(algo, key) is not None}
    values = {**defaults, **(preset_values or {}), **explicit}
    for key, value in zip(("eps_low", "eps_high"), LOSS_CLIP_DEFAULTS.get(values["loss_type"], ())):
        if key not in explicit:
            values[key] = value
    resolved = dataclasses.replace(algo, **values)
    check_algo(resolved)
    return resolved


def check_algo(algo) -> None:
    """ConfigError naming the key for an unknown name or an out-of-range number in ``algo``."""
    for key, registry in NAMED_CHOICES.items():
        if hasattr(algo, key) and getattr(algo, key) not in registry:
            raise ConfigError(f"algo.{key}={getattr(algo, key)!r} is not known; valid: {', '.join(registry)}")
    if not (0.0 <= algo.eps_low < 1.0 and algo.eps_high >= 0.0):
        raise ConfigError(f"need 0 <= algo.eps_low < 1 and algo.eps_high >= 0, got {algo.eps_low}, {algo.eps_high}")
    if algo.dual_clip is not None and algo.dual_clip <= 1.0:
        raise ConfigError(f"algo.dual_clip must be > 1 (or null to disable), got {algo.dual_clip}")
    if algo.kl_coef < 0:
        raise ConfigError(f"algo.kl_coef must be >= 0, got {algo.kl_coef}")
    for key in ("num_iterations", "num_mini_batches"):
        if getattr(algo, key) < 1:
            raise ConfigError(f"algo.{key} must be >= 1, got {getattr(algo, key)}")
    if algo.is_cap <= 0:
        raise ConfigError(f"algo.is_cap must be > 0, got {algo.is_cap}")


def check_rl_config(cfg, algo) -> None:
    """Validate the sections (again: a config built in Python skips ``validate``), then the checks
    that span sections."""
    env = getattr(cfg, "env", None)
    for section_cfg in (cfg.data, cfg.rollout, cfg.optim, cfg.train, *([env] if env else [])):
        section_cfg.validate()
    cfg.rewards.validate(allow_empty=bool(env and env.name) or cfg.rollout.backend == "agent")
    for name, *_ in cfg.rewards.specs(allow_empty=True):
        if name.startswith("rm:") and name[3:]:  # a reward model: its directory, before the run directory is taken
            from ..rollout.reward_model import check_reward_model_dir

            check_reward_model_dir(name[3:])
    check_env(env, cfg)
    if algo.is_level != "none" and cfg.rollout.truncates:
        raise ConfigError(
            f"algo.is_level={algo.is_level} weights by pi_trainer / pi_rollout, but with rollout.top_k / "
            "rollout.top_p the sampler reports logprobs of a truncated, renormalised distribution that "
            "the trainer does not compute, so every weight would be biased; set rollout.top_k=0 and "
            "rollout.top_p=1, or algo.is_level=none"
        )
    batch_rows = cfg.rollout.num_prompts * cfg.rollout.group_size
    if algo.num_mini_batches > batch_rows:
        raise ConfigError(
            f"algo.num_mini_batches={algo.num_mini_batches} exceeds the {batch_rows} completions "
            "of a step (rollout.num_prompts x rollout.group_size)"
        )


def describe_algo(algo) -> str:
    """Every resolved algo key on one line, so a run's log says what the presets amounted to."""
    return " ".join(f"{f.name}={getattr(algo, f.name)}" for f in dataclasses.fields(algo))


def policy_spec(algo) -> PolicyLossSpec:
    """The ``losses.policy_loss`` hyperparameters of a resolved ``algo``: built once per run, so every
    micro-batch's loss reads the same frozen values (``is_level`` "none" is the loss's None: off)."""
    return PolicyLossSpec(
        loss_type=algo.loss_type,
        aggregation=algo.aggregation,
        eps_low=algo.eps_low,
        eps_high=algo.eps_high,
        dual_clip=algo.dual_clip,
        is_level=None if algo.is_level == "none" else algo.is_level,
        is_cap=algo.is_cap,
        kl_coef=algo.kl_coef,
        kl_estimator=algo.kl_estimator,
        entropy_coef=algo.entropy_coef,
    )
