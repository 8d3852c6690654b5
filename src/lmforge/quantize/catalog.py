"""What ``lmforge quantize --help`` says of each format: name -> one line, in the order they are listed.

Literals only: the CLI reads this table from the source (lmforge.core.confighelp) so that help needs no torch,
which the package's writers import. The writers (ct_formats, gguf_format, ternary_format) take their
descriptions from here; tests/quantize/test_formats.py checks both list the same formats in this order.
"""

DESCRIPTIONS = {
    "int8": "int8 weight-only, one scale per output channel",
    "int4-g32": "int4 group-wise, group 32",
    "int4-g64": "int4 group-wise, group 64",
    "int4-g128": "int4 group-wise, group 128",
    "fp8": "fp8 e4m3 weights, one scale per output channel",
    "gguf-f16": "GGUF F16 (llama.cpp, Ollama, transformers)",
    "gguf-bf16": "GGUF BF16 (llama.cpp, Ollama, transformers)",
    "gguf-q8_0": "GGUF Q8_0 (llama.cpp, Ollama, transformers)",
    "gguf-q4_0": "GGUF Q4_0 (llama.cpp, Ollama, transformers)",
    "gguf-tq1_0": "GGUF TQ1_0 (llama.cpp, transformers >= 5.24)",
    "gguf-tq2_0": "GGUF TQ2_0 (llama.cpp, transformers >= 5.24)",
    "ternary": "lmforge packed ternary (absmean), 4 weights per byte",
    "ternary-5trit": "lmforge packed ternary (absmean), 5 weights per byte",
}
