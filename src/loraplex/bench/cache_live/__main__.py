"""``python -m loraplex.bench.cache_live``."""

import sys

from loraplex.bench.cache_live import main

sys.exit(main())
