"""flashtile: FlashAttention, derived.

The public names of Part A (the exact PyTorch reference tier) are re-exported here; the Triton
kernels live in ``flashtile.kernels`` and the SDPA-shaped entry point is ``flashtile.attention``.
"""

from .api import attention
from .decode import decode_attention
from .reference import *  # noqa: F403  (the reference tier's __all__ is the public surface)
from .reference import __all__ as _reference_all
from .varlen import attention_varlen

__version__ = "0.1.0"

__all__ = ["attention", "attention_varlen", "decode_attention", *_reference_all]
