"""Integrations with other serving systems (the top layer: they may import ``server``,
``registry``, ``router``'s proxy pieces and ``testing``; nothing in loraplex imports them).

- :mod:`loraplex.integrations.ray_serve`: a Ray Serve application whose replicas are loraplex
  engines behind an OpenAI-compatible ingress (``pip install loraplex[ray]``).
"""
