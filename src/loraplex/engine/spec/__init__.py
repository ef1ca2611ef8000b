"""Speculative decoding: proposers draft tokens, one step verifies them (``docs/speculative.md``).

- :mod:`.proposer` — the :class:`Proposer` ABC and :class:`Draft`;
- :mod:`.ngram` — prompt lookup over the request's own tokens;
- :mod:`.suffix` — suffix decoding over the request's context and past outputs, kept per tenant
  and adapter;
- :mod:`.draft_model` — a small model sharing the target's tokenizer (with draft adapters);
- :mod:`.verify` — exact verification: greedy matches and rejection sampling;
- :mod:`.control` — how many tokens to draft per sequence and step (adaptive k), and the counts.
"""
