"""Write a smaller proxy for antidistillation: the first K decoder layers of a model, with its own
embeddings, final norm and LM head (tied or not), as a Hugging Face directory with the same tokenizer.

    python examples/make_truncated_proxy.py smollm2-135m-instruct runs/proxy-smollm2-l6 --layers 6

The proxy shares the teacher's tokenizer by construction (what ADS needs: the two models' logits are
added token by token). It is not fine-tuned: examples/antidistill_smollm2.yaml uses it as is; an SFT
run on the teacher's traces (`lmforge sft model.name=OUT ...`) would make it a closer student.
"""

import argparse
import sys

from lmforge.core.config import ModelConfig
from lmforge.model.load import count_parameters, load_model, save_model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "model", help="model spec (HF dir, hub id in the local cache, file.gguf, smollm2-135m-instruct)"
    )
    parser.add_argument("out", help="output directory (HF format)")
    parser.add_argument("--layers", type=int, default=6, help="decoder layers to keep (the first ones)")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(ModelConfig(name=args.model))
    layers = model.model.layers
    if not 1 <= args.layers <= len(layers):
        parser.error(f"--layers must be between 1 and {len(layers)} (the model has {len(layers)}), got {args.layers}")
    before = count_parameters(model)
    del layers[args.layers :]
    model.config.num_hidden_layers = args.layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[: args.layers]
    save_model(model, tokenizer, args.out)
    print(
        f"kept {args.layers} of the decoder layers: {count_parameters(model) / 1e6:.1f}M of "
        f"{before / 1e6:.1f}M parameters -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
