"""``python -m loraplex.tools.bench.cache_live``."""

import sys

from loraplex.tools.bench.cache_live import main

sys.exit(main())
