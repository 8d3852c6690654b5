"""Data pipeline.

- ``lmforge.data.text``:  pretraining text -> packed (N, seq_len + 1) token blocks, cached on disk.
- ``lmforge.data.sft``:   JSONL/Parquet chat or prompt/completion rows -> (input_ids, loss_mask).
- ``lmforge.data.preference``: prompt / chosen / rejected rows -> token pairs; pairs from a task.
- ``lmforge.data.tasks``: built-in synthetic tasks with exact checkers (SFT data and RL rewards).
- ``lmforge.data.source``: rows of any source (JSONL, Parquet, CSV, Arrow, save_to_disk dirs, cached
  hub ids through Hugging Face ``datasets``), column mapping, held-out fractions (docs/data.md).
- ``lmforge.data.prompts``: RL prompt rows and their held-out split.
- ``lmforge.data.stream``: streaming pretraining text, packed as training consumes it.

Import from the submodules; this package imports nothing so that ``lmforge.model.tokenizer`` can use
``lmforge.data.tasks`` without an import cycle.
"""
