"""Data pipeline.

- ``lmforge.data.text``:  pretraining text -> packed (N, seq_len + 1) token blocks, cached on disk.
- ``lmforge.data.sft``:   JSONL/Parquet chat or prompt/completion rows -> (input_ids, loss_mask).
- ``lmforge.data.tasks``: built-in synthetic tasks with exact checkers (SFT data and RL rewards).

Import from the submodules; this package imports nothing so that ``lmforge.tokenizer`` can use
``lmforge.data.tasks`` without an import cycle.
"""
