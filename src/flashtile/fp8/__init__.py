"""FP8 (E4M3) attention: quantising q, k, v and the emulation that says what the FP8 kernel must compute.

quantize           E4M3 codes and float32 per-row factors, per tensor, per head or per block of rows,
                   optionally after a randomized Hadamard rotation of the head dimension
hadamard_rotation  that rotation, one fixed orthonormal matrix per power-of-two D
fp8_attention_forward  (from ``flashtile.reference.fp8``) the float64 emulation of the FP8 forward

``flashtile.attention`` takes the codes and factors ``quantize`` returns (``descale_q``, ``descale_k``,
``descale_v``, ``out_dtype``) and runs them on ``flashtile.fp8.attention``: the FP8 kernel on CUDA, the
emulation on the CPU; forward only.
"""

from ..reference.fp8 import E4M3_MAX, fp8_attention_forward
from .quantize import GRANULARITIES, hadamard_rotation, quantize

__all__ = ["E4M3_MAX", "GRANULARITIES", "fp8_attention_forward", "hadamard_rotation", "quantize"]
