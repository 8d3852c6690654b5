"""Loading and saving models (HF directories, hub ids, GGUF, ``tiny:``), tokenizers, LoRA adapters."""
