"""An Atropos environment (``atroposlib.envs.base.BaseEnv``) on lmforge's built-in addition task.

It samples ``group_size`` completions per problem from an OpenAI-compatible server (``lmforge serve``),
scores them with the task's exact-answer scorer and posts each group to the Atropos API with the
sampled token ids, the masks, the scores, the sampler's logprobs and the weight version that sampled
them -- the batch ``lmforge grpo rollout.backend=atropos`` trains on. docs/atropos.md runs it:

    run-api --host 127.0.0.1 --port 8000
    lmforge serve MODEL_DIR --port 9001 --name lmforge
    python examples/atropos_addition_env.py serve --env.tokenizer_name MODEL_DIR \\
        --openai.base_url http://127.0.0.1:9001/v1 --env.rollout_server_url http://127.0.0.1:8000
    lmforge grpo examples/grpo_atropos.yaml model.name=MODEL_DIR

Prompts are encoded exactly as ``lmforge grpo`` encodes a task's prompts (``encode_prompt``, the chat
template only when the tokenizer has its own), so a model SFT'd by lmforge sees its training format.
The server's extra response fields are used as they are: ``prompt_token_ids`` / ``token_ids`` (no
re-tokenising of text), ``logprobs.token_logprobs`` and ``weight_version``.
"""

from __future__ import annotations

from typing import Any

from atroposlib.envs.base import BaseEnv, BaseEnvConfig, ScoredDataGroup
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from pydantic import Field

from lmforge.data.sft import encode_prompt, uses_chat_format
from lmforge.data.tasks import get_task


class AdditionEnvConfig(BaseEnvConfig):
    task: str = Field(default="addition", description="lmforge task spec (data.task), e.g. addition")
    num_train: int = Field(default=4000, description="training problems cycled through")
    seed: int = Field(default=0, description="seed of the task's problems")
    temperature: float = Field(default=1.0, description="sampling temperature (the trainer's rollout.temperature)")
    max_new_tokens: int = Field(default=6, description="longest completion (the trainer's rollout.max_new_tokens)")
    use_chat_template: str = Field(default="auto", description="auto | on | off, as data.use_chat_template")
    vllm: bool = Field(
        default=False,
        description="the server is vLLM's OpenAI server: ask for token ids with "
        "return_token_ids and send no weight_version (vLLM reports none; unverified here, no GPU)",
    )


class AdditionEnv(BaseEnv):
    name = "lmforge_addition"
    env_config_cls = AdditionEnvConfig

    @classmethod
    def config_init(cls) -> tuple[AdditionEnvConfig, list[APIServerConfig]]:
        env = AdditionEnvConfig(
            group_size=8,
            use_wandb=False,
            steps_per_eval=0,
            max_num_workers_per_node=4,
            max_batches_offpolicy=2,
            ensure_scores_are_not_same=False,
            tokenizer_name="runs/sft_addition/final/model",
            wandb_name="lmforge_addition",
        )
        server = APIServerConfig(
            base_url="http://127.0.0.1:9001/v1",
            api_key="none",
            model_name="lmforge",
            health_check=False,
            num_requests_for_eval=4,
        )
        return env, [server]

    async def setup(self) -> None:
        self.task = get_task(self.config.task)
        self.problems = self.task.make_problems(self.config.num_train, self.config.seed, "train")
        self.chat = uses_chat_format(self.tokenizer, self.config.use_chat_template)
        self.next_index = 0

    async def get_next_item(self) -> Any:
        problem = self.problems[self.next_index % len(self.problems)]
        self.next_index += 1
        return problem

    async def collect_trajectories(self, item) -> tuple[ScoredDataGroup | None, list]:
        prompt_ids = encode_prompt(self.tokenizer, item.prompt, self.chat)
        # lmforge serve refuses fields it does not know; vLLM needs return_token_ids for the sampled ids
        options = {"extra_body": {"return_token_ids": True}} if self.config.vllm else {}
        reply = await self.server.completion(
            prompt=prompt_ids,
            n=self.config.group_size,
            logprobs=1,
            max_tokens=self.config.max_new_tokens,
            temperature=self.config.temperature,
            **options,
        )
        extra = reply.model_extra or {}
        params: dict[str, Any] = {"temperature": self.config.temperature}
        if "weight_version" in extra:  # lmforge serve: staleness = trainer step - this
            params["weight_version"] = int(extra["weight_version"])
        elif not self.config.vllm:
            raise RuntimeError(
                "the inference server sent no weight_version: is it lmforge serve? (for vLLM set "
                "--env.vllm=True; docs/atropos.md)"
            )
        # ScoredDataGroup is a TypedDict: the keys left out (advantages, ref_logprobs, overrides, ...) are
        # filled in by BaseEnv.handle_send_to_api (advantages must stay unset: lmforge computes them)
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[], generation_params=params)
        for choice in reply.choices:
            completion = list(choice.model_extra["token_ids"])
            logprobs = list(choice.logprobs.token_logprobs)
            group["tokens"].append(prompt_ids + completion)
            group["masks"].append([-100] * len(prompt_ids) + completion)
            group["inference_logprobs"].append([1.0] * len(prompt_ids) + logprobs)
            group["scores"].append(float(self.task.score(choice.text, item)))
        return group, []

    async def evaluate(self, *args, **kwargs) -> None:
        """Held-out accuracy is the trainer's (``lmforge grpo`` with ``train.eval_every``)."""
        return None


if __name__ == "__main__":
    AdditionEnv.cli()
