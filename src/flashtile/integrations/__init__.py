"""Integrations of flashtile into other libraries' models.

Each integration is its own module and imports its library only there, so ``import flashtile`` never
needs them:

* ``flashtile.integrations.transformers``: ``register()`` makes flashtile an attention implementation
  of Hugging Face transformers (``attn_implementation="ftile"``).
"""
