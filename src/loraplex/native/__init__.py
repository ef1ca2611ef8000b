"""loraplex's native C kernels: every C source and header, and the one module that builds,
caches, loads and checks them (:mod:`loraplex.native.build`, whose docstring says where a
kernel goes). Below both ``lora`` and ``model``: it imports only the base layer."""
