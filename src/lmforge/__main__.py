"""``python -m lmforge`` (and ``torchrun ... -m lmforge``): the same as the ``lmforge`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
