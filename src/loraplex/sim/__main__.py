"""``python -m loraplex.sim``: the simulator CLI."""

import sys

from loraplex.sim.cli import main

sys.exit(main())
