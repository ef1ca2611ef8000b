"""``python -m loraplex.tools.sim``: the simulator CLI."""

import sys

from loraplex.tools.sim.cli import main

sys.exit(main())
