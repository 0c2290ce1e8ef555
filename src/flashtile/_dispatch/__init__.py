"""The dispatch floor: what the three entry points (``flashtile.attention``, ``flashtile.attention_varlen``,
``flashtile.decode_attention``) share, below them, so that none of them imports another.

* ``tiers``: which tier runs a call (``pick_backend``, ``use_backend``), autocast, the autograd modes the
  custom ops refuse, and which inputs are plain tensors;
* ``dense``: ``flashtile.attention``'s custom ops, their fake and autograd registrations, the eager path, the
  checked call kept per layout and flags, and the dispatch of one checked call to its tier (the decode
  kernels' route included);
* ``varlen``: ``flashtile.attention_varlen``'s custom ops and their implementations;
* ``decode``: ``flashtile.decode_attention``'s checked call, its eager run and its custom op.
"""
