"""Input validation shared by every public entry point.

Each check raises ``TypeError`` when an argument has the wrong kind (not a tensor, not an int, wrong
dtype) and ``ValueError`` when it has the right kind but an unusable value (wrong rank, mismatched
sizes, non-positive block). Messages always name the argument and say what was expected, so a user
never has to read a stack trace into the kernels.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

ALIGNMENTS = ("upper_left", "lower_right")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class AttentionShape(NamedTuple):
    """Sizes of one attention call: q is (B, H, Tq, D), k and v are (B, H_kv, Tk, D)."""

    B: int
    H: int
    H_kv: int
    Tq: int
    Tk: int
    D: int

    @property
    def group(self) -> int:
        """Query heads per key/value head (1 for MHA, H for MQA)."""
        return self.H // self.H_kv


def check_tensor(name: str, x, *, rank: int | None = None, dtypes=FLOAT_DTYPES) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None and x.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(x.dtype).replace('torch.', '')}")
    if rank is not None and x.dim() != rank:
        raise ValueError(f"{name} must be a rank-{rank} tensor, got shape {tuple(x.shape)} (rank {x.dim()})")
    return x


def check_same(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """x must share dtype and device with ref."""
    if x.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but {ref_name} has dtype {ref.dtype}; they must match")
    if x.device != ref.device:
        raise ValueError(f"{name} is on {x.device} but {ref_name} is on {ref.device}; they must match")


def check_attention_inputs(q, k, v, *, dtypes=FLOAT_DTYPES, names=("q", "k", "v")) -> AttentionShape:
    """Validate q (B, H, Tq, D), k and v (B, H_kv, Tk, D) and return their sizes.

    ``names`` are the argument names the caller's users see (SDPA-style APIs say query, key, value).
    """
    nq, nk, nv = names
    check_tensor(nq, q, rank=4, dtypes=dtypes)
    check_tensor(nk, k, rank=4, dtypes=dtypes)
    check_tensor(nv, v, rank=4, dtypes=dtypes)
    check_same(nk, k, nq, q)
    check_same(nv, v, nq, q)
    for name, t in ((nq, q), (nk, k), (nv, v)):
        if t.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)}); every dimension must be at least 1")
    B, H, Tq, D = q.shape
    Bk, H_kv, Tk, Dk = k.shape
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"{nv} must have the same shape as {nk} {tuple(k.shape)}, got {tuple(v.shape)}")
    if Bk != B:
        raise ValueError(f"{nk} has batch size {Bk} but {nq} has {B}; the batch dimension (dim 0) must match")
    if Dk != D:
        raise ValueError(f"{nk} has head dim {Dk} but {nq} has {D}; the head dim (dim 3) must match")
    if H % H_kv != 0:
        raise ValueError(
            f"{nq} has {H} heads but {nk} and {nv} have {H_kv}; the number of query heads must be a multiple of "
            "the number of key/value heads (GQA/MQA)"
        )
    return AttentionShape(B, H, H_kv, Tq, Tk, D)


def check_like(name: str, x, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    """x must be a tensor with exactly ref's shape, dtype and device (o, do, ...)."""
    check_tensor(name, x, dtypes=None)
    check_same(name, x, ref_name, ref)
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"{name} must have shape {tuple(ref.shape)} like {ref_name}, got {tuple(x.shape)}")
    return x


def check_lse(lse, shape: AttentionShape, q: torch.Tensor) -> torch.Tensor:
    check_tensor("lse", lse, rank=3, dtypes=(torch.float32, torch.float64))
    expected = (shape.B, shape.H, shape.Tq)
    if tuple(lse.shape) != expected:
        raise ValueError(f"lse must have shape (B, H, Tq) = {expected}, got {tuple(lse.shape)}")
    if lse.device != q.device:
        raise ValueError(f"lse is on {lse.device} but q is on {q.device}; they must match")
    return lse


def check_block(name: str, value) -> int:
    """A tile size: a positive Python int (bool is rejected, it is an int only by accident)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def check_alignment(alignment) -> str:
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment must be one of {ALIGNMENTS}, got {alignment!r}")
    return alignment


def check_causal(causal, name: str = "causal") -> bool:
    if not isinstance(causal, bool):
        raise TypeError(f"{name} must be a bool, got {type(causal).__name__} {causal!r}")
    return causal


def resolve_scale(scale, D: int) -> float:
    """Softmax scale: 1/sqrt(D) by default, otherwise a finite real number."""
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__} {scale!r}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)
