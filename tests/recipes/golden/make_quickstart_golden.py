"""Regenerate ``quickstart_small.json``: the loss curves of a small quickstart run.

Run it only for a change that is meant to alter the computation, and say so in the commit:

    python tests/recipes/golden/make_quickstart_golden.py

A refactor must leave the file as it is (``tests/recipes/test_quickstart_golden.py`` checks it).
"""

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from test_quickstart_golden import ARGS, GOLDEN, curves, machine  # noqa: E402

from lmforge.cli import main  # noqa: E402

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "qs"
        assert main(["quickstart", f"output_dir={out}", *ARGS]) == 0
        record = {"machine": machine(), "args": ARGS, **curves(out)}
    GOLDEN.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {GOLDEN}")
