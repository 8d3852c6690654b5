"""Parallel training: the process group and its context, data-parallel wrapping (DDP / FSDP2), and
the ring all-reduce."""
