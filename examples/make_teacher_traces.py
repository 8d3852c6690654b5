"""Teacher traces for the SFT baseline of docs/distillation.md: one sampled completion of the teacher for
each of N training problems of a built-in task, as prompt/completion JSONL rows that `lmforge sft` reads.

    python examples/make_teacher_traces.py TEACHER_DIR OUT.jsonl [--task addition] [--num 8000]
        [--temperature 1.0] [--seed 0]

The prompts are the task's training problems (split "train", seeded like `lmforge sft data.task=...`);
the completions are sampled at --temperature (1.0: the teacher's own distribution, as the on-policy
student sees it), kept whether right or wrong; the count of correct ones is printed.
"""

from __future__ import annotations

import argparse
import json

import torch

from lmforge.core.config import ModelConfig
from lmforge.data.sft import encode_prompt, uses_chat_format
from lmforge.data.tasks import get_task
from lmforge.model.load import load_model
from lmforge.rollout import SamplingParams, generate
from lmforge.rollout.evaluation import completion_texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("teacher")
    parser.add_argument("out")
    parser.add_argument("--task", default="addition")
    parser.add_argument("--num", type=int, default=8000)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model, tokenizer = load_model(ModelConfig(name=args.teacher))
    model.eval()
    task = get_task(args.task)
    problems = task.make_problems(args.num, args.seed, "train")
    chat = uses_chat_format(tokenizer, "auto")
    rows, correct = [], 0
    for start in range(0, len(problems), 256):
        chunk = problems[start : start + 256]
        params = SamplingParams(
            temperature=args.temperature,
            max_new_tokens=args.max_new_tokens,
            stop_token_ids=[tokenizer.eos_token_id],
            seed=args.seed + start,
        )
        with torch.no_grad():
            batch = generate(
                model,
                [encode_prompt(tokenizer, p.prompt, chat) for p in chunk],
                params,
                num_samples=1,
                pad_token_id=tokenizer.pad_token_id,
            )
        for problem, text in zip(chunk, completion_texts(tokenizer, batch)):
            correct += task.is_correct(text, problem)
            rows.append({"prompt": problem.prompt, "completion": text})
    with open(args.out, "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    print(
        f"{len(rows)} traces of {args.teacher} at temperature {args.temperature}: {correct} correct "
        f"({correct / len(rows):.1%}) -> {args.out}"
    )


if __name__ == "__main__":
    main()
