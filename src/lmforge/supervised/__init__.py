"""The supervised pieces the commands share: the step and its loop, SFT rows and their evaluation, preference pairs
and their packed forward."""
