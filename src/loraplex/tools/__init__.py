"""The user tools, on top of everything and imported by nothing but the command line:

- ``plan`` (``loraplex plan``): the capacity planner (adapter bytes, slots against KV, decode bytes);
- ``verify`` (``loraplex verify``): an adapter checked against a transformers + PEFT reference;
- ``bench`` (``loraplex bench`` and ``python -m loraplex.tools.bench.*``): the load generator and
  the benchmarks;
- ``sim`` (``loraplex sim``): the cache simulator (no torch);
- ``demo`` (``loraplex demo``): the embedded demo model and adapters.
"""
