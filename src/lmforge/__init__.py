"""lmforge: train language models end to end on a laptop CPU or many GPUs."""

__version__ = "0.1.0"
