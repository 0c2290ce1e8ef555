"""Input validation shared by every public entry point: one contract for every tier.

Each check raises ``TypeError`` when an argument has the wrong kind (not a tensor, not an int, wrong
dtype) and ``ValueError`` when it has the right kind but an unusable value (wrong rank, mismatched
sizes, non-positive block). Messages always name the argument and say what was expected, so a user
never has to read a stack trace into the kernels.

The contract is the same whichever tier runs (the PyTorch reference, the Triton interpreter or the
compiled kernels): an input the kernels cannot take is refused here, by every tier, rather than
accepted by one and refused by another. The limits that exist only because of GPU hardware (a head
dim of at most 256, the grid's 65,535 heads) are therefore part of the contract everywhere.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np
import torch

ALIGNMENTS = ("upper_left", "lower_right")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256  # the largest head dim the kernels keep in registers; the contract for every tier
FLOAT32_MAX = torch.finfo(torch.float32).max


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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_tensor(name: str, x, *, rank: int | None = None, dtypes=FLOAT_DTYPES) -> torch.Tensor:
    """x is a dense (strided) tensor with real data, of an allowed dtype and rank."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}; call .to_dense() first")
    if dtypes is not None and x.dtype not in dtypes:
        allowed = ", ".join(_dtype_name(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {_dtype_name(x.dtype)}")
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
    if D > MAX_HEAD_DIM:
        raise ValueError(
            f"{nq} has head dim {D}; flashtile supports head dims 1 to {MAX_HEAD_DIM} on every tier (the kernels "
            f"keep a row of the head dim in registers); split the heads or use torch's scaled_dot_product_attention"
        )
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


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of lse and of every running statistic: float64 for float64 inputs, float32 otherwise.

    16-bit inputs keep their statistics in float32 on every tier, as the kernels' registers do; a 16-bit
    lse would lose the digits the backward needs to recompute P.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_lse(lse, shape: AttentionShape, q: torch.Tensor) -> torch.Tensor:
    """lse is (B, H, Tq) in ``stats_dtype(q.dtype)``, on q's device."""
    check_tensor("lse", lse, rank=3, dtypes=(torch.float32, torch.float64))
    expected = (shape.B, shape.H, shape.Tq)
    if tuple(lse.shape) != expected:
        raise ValueError(f"lse must have shape (B, H, Tq) = {expected}, got {tuple(lse.shape)}")
    if lse.dtype != stats_dtype(q.dtype):
        raise TypeError(
            f"lse must have dtype {_dtype_name(stats_dtype(q.dtype))} for {_dtype_name(q.dtype)} inputs "
            f"(the forward's own lse), got {_dtype_name(lse.dtype)}"
        )
    if lse.device != q.device:
        raise ValueError(f"lse is on {lse.device} but q is on {q.device}; they must match")
    return lse


def check_int(name: str, value, *, minimum: int = 1) -> int:
    """An integer argument (Python or NumPy int; bool is refused: it is an int only by accident)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


def check_block(name: str, value) -> int:
    """A tile size: a positive int."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if int(value) <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return int(value)


def check_alignment(alignment) -> str:
    if not isinstance(alignment, str) or alignment not in ALIGNMENTS:
        raise ValueError(f"alignment must be one of {ALIGNMENTS}, got {alignment!r}")
    return alignment


# --8<-- [start:flags]
def check_flag(name: str, value) -> bool:
    """A yes/no argument: a Python or NumPy bool. Anything else (1, "no", None) is refused, because
    ``bool("no")`` is True and a silently enabled option is worse than an error."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_causal(causal, name: str = "causal") -> bool:
    return check_flag(name, causal)


def resolve_scale(scale, D: int, dtype: torch.dtype | None = None) -> float:
    """Softmax scale τ: 1/sqrt(D) by default, otherwise a finite real number (zero and negative allowed).

    With ``dtype`` given, a scale too large for the arithmetic of that dtype is refused: everything but
    float64 computes in float32, where τ · log2(e) must stay finite.
    """
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__} {scale!r}")
    try:
        value = float(scale)
    except OverflowError:
        digits = len(str(abs(scale)))
        raise ValueError(f"scale must be finite, got an int too large for a float ({digits} digits)") from None
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    limit = FLOAT32_MAX / math.log2(math.e)
    if dtype is not None and dtype != torch.float64 and abs(value) > limit:
        raise ValueError(
            f"scale must be at most {limit:.3e} in magnitude for {_dtype_name(dtype)} inputs (the statistics are "
            f"float32), got {value:.3e}; use float64 inputs for larger scales"
        )
    return value
# --8<-- [end:flags]
