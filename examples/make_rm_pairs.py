"""Preference pairs from a policy's own samples, for a reward model that GRPO on that policy cannot
fool as easily: for each addition problem, sample ``--samples`` completions at temperature 1 and pair
the right answer (chosen) with the first wrong sample (rejected; a rule-made wrong answer -- dropped
carry, a digit off by one -- where every sample was right). One pair per prompt.

    python examples/make_rm_pairs.py --model runs/sft_addition_brief/final --out runs/rm_pairs.jsonl
    lmforge rm examples/rm_addition.yaml data.task= data.rejected=rule data.path=runs/rm_pairs.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict

import torch

from lmforge.core.config import ModelConfig
from lmforge.data.preference import wrong_completion
from lmforge.data.tasks import get_task
from lmforge.model.load import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the policy's HF directory")
    parser.add_argument("--out", required=True, help="JSONL file of prompt / chosen / rejected rows")
    parser.add_argument("--num", type=int, default=4000, help="problems (one pair each)")
    parser.add_argument("--samples", type=int, default=8, help="samples per problem")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", default="train")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(ModelConfig(name=args.model))
    model.eval()
    task = get_task("addition")
    problems = task.make_problems(args.num, args.seed, args.split)
    by_length = defaultdict(list)  # prompts of one length batch without padding
    for index, problem in enumerate(problems):
        by_length[len(tokenizer(problem.prompt, add_special_tokens=False)["input_ids"])].append(index)
    samples: dict[int, list[str]] = {}
    with torch.no_grad():
        for indices in by_length.values():
            for k in range(0, len(indices), 256):
                chunk = indices[k : k + 256]
                ids = torch.tensor(
                    [tokenizer(problems[i].prompt, add_special_tokens=False)["input_ids"] for i in chunk]
                )
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    max_new_tokens=6,
                    num_return_sequences=args.samples,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                )
                texts = tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
                for j, i in enumerate(chunk):
                    samples[i] = [t.strip() for t in texts[j * args.samples : (j + 1) * args.samples]]
    rng, num_sampled = random.Random(args.seed), 0
    with open(args.out, "w") as f:
        for index, problem in enumerate(problems):
            wrong = [s for s in samples[index] if s and not task.is_correct(s, problem)]
            rejected = wrong[0] if wrong else wrong_completion(problem.prompt, problem.completion, rng)
            num_sampled += bool(wrong)
            f.write(json.dumps({"prompt": problem.prompt, "chosen": problem.completion, "rejected": rejected}) + "\n")
    print(f"{args.num} pairs to {args.out}: {num_sampled} with a sampled wrong answer, the rest rule-made")


if __name__ == "__main__":
    main()
