"""The PEFT LoRA adapter format as loraplex serves it, written once and without torch.

Everything the loader (:mod:`loraplex.lora.adapter`), the registry
(:mod:`loraplex.registry.inspect`) and the planning tools (:mod:`loraplex.tools.plan`,
:mod:`loraplex.tools.verify`) know about an adapter directory lives here, one job a module:

- :mod:`~loraplex.lora.peft.files`: the file names (``adapter_config.json`` +
  ``adapter_model.safetensors``, or the older ``adapter_model.bin``) and which weights file a
  directory is read from;
- :mod:`~loraplex.lora.peft.config`: the config features we refuse (DoRA, biases,
  modules_to_save, base-modifying inits, ...), checked by ``parse_lora_config``;
- :mod:`~loraplex.lora.peft.targets`: PEFT's module selection and per-module rank/scale
  (``LoraSettings``: ``target_modules`` as a list, a regex or ``all-linear``,
  ``exclude_modules``, ``layers_to_transform`` with ``layers_pattern``, ``rank_pattern`` /
  ``alpha_pattern``, ``target_parameters``);
- :mod:`~loraplex.lora.peft.tensors`: the tensor names PEFT saves (``lora_A`` / ``lora_B`` of
  a projection, ``lora_embedding_A/B`` of the embedding, per-expert and packed experts, the
  router, PEFT's copies of the base's embedding matrices) and why an unknown one is refused;
- :mod:`~loraplex.lora.peft.layout`: what a set of tensors must look like for a base model
  (``check_layout``: every tensor a LoRA A/B of a targeted module, ``A: [r, d_in]``,
  ``B: [d_out, r]``, the configured rank, every targeted module present);
- :mod:`~loraplex.lora.peft.experts`: the same check for a mixture-of-experts base's experts.

What the base model's modules are called and their shapes (the seven projections, Phi-3's fused
modules, the embedding and LM head, a MoE block's router and experts, ``BaseModelSpec``) are
facts of the base's checkpoint: :mod:`loraplex.checkpoint.modules`.

Each refusal is a :class:`~loraplex.lora.peft.errors.FormatError` with a registry ``reason``
code and a message; the loader wraps it into an ``AdapterError`` naming the path, the registry
into a ``ValidationError`` carrying the reason.
"""
