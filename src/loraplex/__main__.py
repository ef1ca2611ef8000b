"""``python -m loraplex ...``: the ``loraplex`` command (as ``python -m vllm.entrypoints...``)."""

import sys

from loraplex.cli import main

if __name__ == "__main__":
    sys.exit(main())
