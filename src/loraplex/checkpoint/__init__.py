"""Facts about a base model's checkpoint, without torch: what ``model/`` (loading a base) and
``lora/`` (checking an adapter against that base) both need, so neither reads the other's
internals.

- :mod:`loraplex.checkpoint.safetensors`: loraplex's one safetensors header reader (the dtype
  table, the header's bounds, :class:`~loraplex.checkpoint.safetensors.SafetensorsError`).
- :mod:`loraplex.checkpoint.modules`: what a base model's adaptable modules are called and
  their shapes (the seven projections and the fused ones of Phi-3, the embedding and LM head, a
  mixture-of-experts block's router and experts), and ``BaseModelSpec`` / ``MoESpec`` built
  from ``config.json``.

It imports only the base layer (types, config), so the registry may use it too.
"""
