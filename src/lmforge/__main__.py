"""``python -m lmforge`` (and ``torchrun ... -m lmforge``): the same as the ``lmforge`` command."""
import sys

from .cli import main

sys.exit(main())
