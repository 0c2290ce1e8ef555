"""Input validation shared by every public entry point: one contract for every tier.

Each check raises ``TypeError`` when an argument has the wrong kind (not a tensor, not an int, wrong
dtype) and ``ValueError`` when it has the right kind but an unusable value (wrong rank, mismatched
sizes, non-positive block). Messages always name the argument and say what was expected, so a user
never has to read a stack trace into the kernels.

The contract is the same whichever tier runs (the PyTorch reference, the Triton interpreter or the
compiled kernels): an input the kernels cannot take is refused here, by every tier, rather than
accepted by one and refused by another. The limits that exist only because of GPU hardware (a head
dim of at most 256, the grid's 65,535 heads) are therefore part of the contract everywhere.

A view's negative bit (``x.is_neg()``, e.g. the imaginary part of a conjugate) is a flag on the tensor,
not in its memory: PyTorch's operators honour it, a Triton kernel reading the raw memory would not. The
public entry points resolve it first (``resolve_neg_bits``), so every tier reads a view's values.
Complex tensors (the only ones with a conjugate bit) are refused by dtype everywhere.

The decode contract (``flashtile.decode_attention``) lives here too, below the reference tier and the
kernels that both check with it.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np
import torch

from ._plans import recall_fact, remember_fact  # kept facts about values: the caches live in _plans

ALIGNMENTS = ("upper_left", "lower_right")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256  # the largest head dim the kernels keep in registers; the contract for every tier
FLOAT32_MAX = torch.finfo(torch.float32).max
FLOAT32_TINY = torch.finfo(torch.float32).tiny


class AttentionShape(NamedTuple):
    """Sizes of one attention call: q and k are (B, H, Tq, D) and (B, H_kv, Tk, D), v (B, H_kv, Tk, d_v), where
    the callers that take a value head dim of its own read d_v from v (``check_attention_inputs``)."""

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


def resolve_neg_bits(*xs):
    """Each x, with its negative bit resolved (a copy holding the values) where it is set; other
    arguments (non-tensors, tensors without the bit) come back as they are, for the checks to judge."""
    if torch.compiler.is_compiling():  # torch.compile cannot trace is_neg(); resolve_neg() is an alias when unset
        return tuple(x.resolve_neg() if isinstance(x, torch.Tensor) else x for x in xs)
    for x in xs:  # every call passes here, and almost none has the bit: a plain loop, then xs as they came
        if isinstance(x, torch.Tensor) and x.is_neg():
            return tuple(x.resolve_neg() if isinstance(x, torch.Tensor) else x for x in xs)
    return xs


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


def check_values_in_memory(name: str, x: torch.Tensor) -> None:
    """x's memory holds its values: no negative bit (``resolve_neg_bits`` clears it at the public entry
    points). The kernels read memory, so a launcher given such a view would compute with -x; every tier's
    functions below the public ones refuse it alike."""
    if not torch.compiler.is_compiling() and x.is_neg():  # compiled calls resolved it; is_neg is not traceable
        raise ValueError(
            f"{name} is a view with the negative bit set (x.is_neg(), e.g. z.conj().imag): its memory holds the "
            f"negated values, which the kernels would read; pass {name}.resolve_neg(), or call flashtile.attention "
            "or flashtile.decode_attention, which resolve it"
        )


def check_same(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """x must share dtype and device with ref."""
    if x.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but {ref_name} has dtype {ref.dtype}; they must match")
    if x.device != ref.device:
        raise ValueError(f"{name} is on {x.device} but {ref_name} is on {ref.device}; they must match")


def check_attention_inputs(q, k, v, *, dtypes=FLOAT_DTYPES, names=("q", "k", "v"),
                           unequal_head_dims: bool = False) -> AttentionShape:  # fmt: skip
    """Validate q (B, H, Tq, D), k and v (B, H_kv, Tk, D) and return their sizes.

    ``names`` are the argument names the caller's users see (SDPA-style APIs say query, key, value).
    ``unequal_head_dims``: v may have a head dim d_v of its own, 1 to ``MAX_HEAD_DIM`` (``check_value``),
    for the callers whose every tier takes one (``flashtile.attention`` and the kernels below it); the
    others keep v's shape equal to k's. D in the returned sizes is always q's and k's head dim, d_qk.
    """
    nq, nk, nv = names
    check_tensor(nq, q, rank=4, dtypes=dtypes)
    check_tensor(nk, k, rank=4, dtypes=dtypes)
    check_tensor(nv, v, rank=4, dtypes=dtypes)
    check_same(nk, k, nq, q)
    check_same(nv, v, nq, q)
    for name, t in ((nq, q), (nk, k), (nv, v)):
        check_values_in_memory(name, t)
        # with a head dim of its own, v's d_v of 0 is a head dim out of range (``check_value``, below)
        if t.numel() == 0 and not (unequal_head_dims and t is v and v.shape[-1] == 0):
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)}); every dimension must be at least 1")
    B, H, Tq, D = q.shape
    Bk, H_kv, Tk, Dk = k.shape
    if Bk != B:
        raise ValueError(f"{nk} has batch size {Bk} but {nq} has {B}; the batch dimension (dim 0) must match")
    if Dk != D:
        raise ValueError(f"{nk} has head dim {Dk} but {nq} has {D}; the head dim (dim 3) must match")
    if D > MAX_HEAD_DIM:
        raise ValueError(
            f"{nq} has head dim {D}; flashtile supports head dims 1 to {MAX_HEAD_DIM} on every tier (the kernels "
            f"keep a row of the head dim in registers); split the heads or use torch's scaled_dot_product_attention"
        )
    # v after q and k, in one order whether or not its head dim may differ: the two give
    # one message for an input both refuse
    check_value(v, k, names=(nk, nv), dims=("batch size", "key/value heads", "length"),
                same_head_dim=not unequal_head_dims)  # fmt: skip
    if H % H_kv != 0:
        raise ValueError(
            f"{nq} has {H} heads but {nk} and {nv} have {H_kv}; the number of query heads must be a multiple of "
            "the number of key/value heads (GQA/MQA)"
        )
    return AttentionShape(B, H, H_kv, Tq, Tk, D)


def check_value(v: torch.Tensor, k: torch.Tensor, *, names: tuple[str, str], dims: tuple[str, ...],
                same_head_dim: bool = False) -> int:  # fmt: skip
    """v matches k in every dim but the last, its head dim d_v, which lies in 1 .. ``MAX_HEAD_DIM``; returns d_v.
    With ``same_head_dim`` (a caller that takes one head dim for q, k and v), d_v must also be k's.

    ``dims`` names k's dims before the head dim, for the message (d_qk and d_v are free to differ: q . k
    contracts over d_qk, and o takes v's d_v)."""
    nk, nv = names
    d_v = v.shape[-1]
    if not same_head_dim and not 1 <= d_v <= MAX_HEAD_DIM:
        raise ValueError(
            f"{nv} has head dim d_v = {d_v}; flashtile supports value head dims 1 to {MAX_HEAD_DIM} on every tier "
            "(the kernels keep a row of it in registers)"
        )
    for dim, what in enumerate(dims):
        if v.shape[dim] != k.shape[dim]:
            raise ValueError(
                f"{nv} must have the same shape as {nk} {tuple(k.shape)} in every dim but the last (its head dim "
                f"may differ), got {tuple(v.shape)}: {nv} has {what} {v.shape[dim]} (dim {dim}), {nk} "
                f"{k.shape[dim]}"
            )
    if same_head_dim and d_v != k.shape[-1]:
        raise ValueError(f"{nv} must have the same shape as {nk} {tuple(k.shape)}, got {tuple(v.shape)}")
    return d_v


def check_like(name: str, x, ref_name: str, ref: torch.Tensor, head_dim: int | None = None) -> torch.Tensor:
    """x must be a tensor with exactly ref's shape, dtype and device (o, do, ...); with ``head_dim``, ref's
    shape with that last dim (o and do of a call whose value head dim d_v differs from q's)."""
    check_tensor(name, x, dtypes=None)
    check_same(name, x, ref_name, ref)
    check_values_in_memory(name, x)
    if head_dim is None or head_dim == ref.shape[-1]:
        if tuple(x.shape) != tuple(ref.shape):
            raise ValueError(f"{name} must have shape {tuple(ref.shape)} like {ref_name}, got {tuple(x.shape)}")
    elif tuple(x.shape) != (*ref.shape[:-1], head_dim):
        raise ValueError(f"{name} must have shape {(*ref.shape[:-1], head_dim)}, {ref_name}'s with v's head dim "
                         f"d_v = {head_dim}, got {tuple(x.shape)}")
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
    check_values_in_memory("lse", lse)
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


def check_sinks_layout(sinks, shape: AttentionShape, dtype: torch.dtype, device) -> torch.Tensor | None:
    """sinks is None or a (H,) tensor of float32 or the inputs' ``dtype`` on their ``device``: what a call's
    layout fixes (``flashtile.attention`` checks it once per kept call). Returns the sinks as they came."""
    if sinks is None:
        return None
    check_tensor("sinks", sinks, rank=1, dtypes=tuple(dict.fromkeys((torch.float32, dtype))))
    check_values_in_memory("sinks", sinks)
    if tuple(sinks.shape) != (shape.H,):
        raise ValueError(
            f"sinks must have shape (H,) = ({shape.H},), one logit per query head, got {tuple(sinks.shape)}"
        )
    if sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {device}; they must match")
    return sinks


def sink_limit(scale: float, softcap: float | None, dtype: torch.dtype) -> float:
    """The largest |sink| a call takes: any finite one for float64 inputs (the reference tier, in float64);
    else half of what keeps the kernels' float32 start state finite: sink * log2(e), the start's shift, and
    without a soft-cap sink / |τ|, the start in the loop's units (raw dots q·k; the kernels take |τ| as 1
    where it is too small for float32, as ``kernels._host.kernel_scale`` does)."""
    if dtype == torch.float64:
        return math.inf
    limit = FLOAT32_MAX / math.log2(math.e)
    unit = abs(scale)
    if softcap is None and unit * math.log2(math.e) >= FLOAT32_TINY:
        limit = min(limit, FLOAT32_MAX * unit)
    return limit / 2


def check_sink_values(sinks: torch.Tensor, limit: float = math.inf) -> None:
    """No NaN and no +inf among the sinks (-inf is allowed: no sink for that head), and no finite one past
    ``limit`` in magnitude (``sink_limit``).

    One read of the device gives both facts: whether a NaN or +inf is there, and the largest finite |sink|.
    Reading waits for the device, so the second is kept until the tensor is written to (``remember_fact``:
    an optimizer's in-place step bumps its version count, and the next call reads the values again); a
    model's fixed sinks are read once. Not run inside a ``torch.compile`` graph, which cannot branch on
    values, nor for meta or fake tensors, which hold none. A write that bypasses the version count is not
    seen: a NaN sink then gives NaN rows, never a read outside a tensor."""
    largest = recall_fact("largest finite |sink|", sinks)
    if largest is None:
        if sinks.is_meta or _is_fake(sinks):
            return
        finite = torch.isfinite(sinks)
        bad = (torch.isnan(sinks) | torch.isposinf(sinks)).any()
        bad, largest = torch.stack([bad.double(), torch.where(finite, sinks.abs(), 0).max().double()]).tolist()
        if bad:
            raise ValueError(
                f"sinks must be finite or -inf (-inf means no sink), got {sinks.tolist()}: a NaN or +inf sink "
                "would make every row of its head NaN or zero"
            )
        remember_fact("largest finite |sink|", sinks, largest)
    if largest > limit:
        raise ValueError(
            f"sinks must be at most {limit:.3e} in magnitude for this call, got {largest:.3e}: the kernels' "
            "float32 start state holds sink * log2(e) and, without a softcap, sink / |scale|; use float64 "
            "inputs for larger sinks"
        )


def _is_fake(t: torch.Tensor) -> bool:
    """A FakeTensor (torch.compile's shape propagation): it has a device but no values."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def check_sinks(sinks, shape: AttentionShape, q: torch.Tensor, limit: float = math.inf) -> torch.Tensor | None:
    """sinks is None or a (H,) tensor of float32 or q's dtype on q's device, no NaN or +inf (-inf allowed),
    none past ``limit`` in magnitude: ``check_sinks_layout`` and ``check_sink_values``. Returns the sinks as
    they came (None stays None)."""
    if check_sinks_layout(sinks, shape, q.dtype, q.device) is not None:
        check_sink_values(sinks, limit)
    return sinks


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
    """A yes/no argument: a Python or NumPy bool. Anything else (1, "no", None) is
    refused, because ``bool("no")`` is True and a silently enabled option is worse than
    an error."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_causal(causal, name: str = "causal") -> bool:
    return check_flag(name, causal)


def is_finite(value: float) -> bool:
    """``math.isfinite(value)`` in comparisons torch.compile can trace: dynamo refuses
    ``math.isfinite`` on a float it traces symbolically (a module attribute or an
    argument under ``dynamic=True``), and handles these."""
    # NaN is the one float unequal to itself
    return value == value and abs(value) != math.inf


def real_to_float(name: str, value) -> float:
    """``float(value)`` of a real number, or a ValueError naming the argument where it
    has no float (an int or a Fraction beyond the float range, which ``float`` meets
    with a bare OverflowError)."""
    # the common case (and a traced float): nothing to convert
    if value.__class__ is float:
        return value
    try:
        return float(value)
    except OverflowError:
        digits = len(str(abs(int(value))))
        kind = "an int" if isinstance(value, numbers.Integral) else "a number"
        raise ValueError(f"{name} must be finite, got {kind} too large for a float "
                         f"({digits} digits)") from None


def resolve_scale(scale, D: int, dtype: torch.dtype | None = None) -> float:
    """Softmax scale τ: 1/sqrt(D) by default (D the head dim of q and k, d_qk),
    otherwise a finite real number (zero and negative allowed).

    With ``dtype`` given, a scale too large for the arithmetic of that dtype is refused:
    everything but float64 computes in float32, where τ · log2(e) must stay finite.
    """
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got "
                        f"{type(scale).__name__} {scale!r}")
    value = real_to_float("scale", scale)
    if not is_finite(value):
        raise ValueError(f"scale must be finite, got {value}")
    limit = FLOAT32_MAX / math.log2(math.e)
    if dtype is not None and dtype != torch.float64 and abs(value) > limit:
        raise ValueError(
            f"scale must be at most {limit:.3e} in magnitude for {_dtype_name(dtype)} "
            f"inputs (the statistics are float32), got {value:.3e}; use float64 inputs "
            "for larger scales"
        )
    return value
# --8<-- [end:flags]


# --- decode: a few new tokens against a KV cache (``flashtile.decode_attention``) ----------------------

MAX_NEW_TOKENS = 16  # Tq: a decode step (1) or a short speculative / chunked step (up to 16)
MAX_SPLITS = 128  # the most slices one sequence's keys are cut into


class DecodeShape(NamedTuple):
    """Sizes of one decode call: D is the query/key head dim d_qk, D_v the value head dim d_v (o's).
    ``page_size`` is None for a contiguous cache."""

    B: int
    H: int
    H_kv: int
    Tq: int
    D: int
    capacity: int  # the most keys a sequence can hold: T_max, or max_pages * page_size
    page_size: int | None
    num_pages: int
    D_v: int

    @property
    def group(self) -> int:
        """Query heads per key/value head (g = H / H_kv)."""
        return self.H // self.H_kv


def check_decode_inputs(
    query, key_cache, value_cache, cache_seqlens=None, block_table=None, *, dtypes=FLOAT_DTYPES, check_values=True
) -> DecodeShape:
    """Validate every argument of a decode call; return its sizes. ``check_values`` also reads
    ``cache_seqlens`` and ``block_table`` on the host (one copy of B + B * max_pages int32s), through
    their strides: the kernels read them through the same strides, so what is checked is what is read."""
    check_tensor("query", query, rank=4, dtypes=dtypes)
    check_tensor("key_cache", key_cache, rank=4, dtypes=dtypes)
    check_tensor("value_cache", value_cache, rank=4, dtypes=dtypes)
    check_same("key_cache", key_cache, "query", query)
    check_same("value_cache", value_cache, "query", query)
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        check_values_in_memory(name, t)
    # every dim as key_cache's but the last, the value head dim d_v (1 to MAX_HEAD_DIM)
    D_v = check_value(value_cache, key_cache, names=("key_cache", "value_cache"),
                      dims=("pages (or batch size)", "key/value heads", "slots"))  # fmt: skip
    for name, t in (("query", query), ("key_cache", key_cache)):
        if t.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)}); every dimension must be at least 1")
    B, H, Tq, D = query.shape
    n0, H_kv, slots, Dk = key_cache.shape
    if Tq > MAX_NEW_TOKENS:
        raise ValueError(f"query has {Tq} new tokens (dim 2); decode_attention takes 1 to {MAX_NEW_TOKENS}: "
                         "use flashtile.attention(..., is_causal=True, alignment='lower_right') for a prefill")
    if Dk != D:
        raise ValueError(f"key_cache has head dim {Dk} but query has {D}; the query/key head dim d_qk (dim 3) "
                         "must match")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"query has head dim {D}; flashtile supports head dims 1 to {MAX_HEAD_DIM}")
    if H % H_kv:
        raise ValueError(f"query has {H} heads but key_cache has {H_kv}; the number of query heads must be a "
                         "multiple of the number of key/value heads (GQA)")
    if block_table is None:
        if n0 != B:
            raise ValueError(f"key_cache has batch size {n0} but query has {B}; without a block_table the cache "
                             "is (B, H_kv, T_max, D)")
        shape = DecodeShape(B, H, H_kv, Tq, D, capacity=slots, page_size=None, num_pages=0, D_v=D_v)
    else:
        check_tensor("block_table", block_table, rank=2, dtypes=(torch.int32,))
        check_values_in_memory("block_table", block_table)
        if block_table.device != query.device:
            raise ValueError(f"block_table is on {block_table.device} but query is on {query.device}")
        if block_table.shape[0] != B or block_table.shape[1] == 0:
            raise ValueError(f"block_table must have shape (B, max_pages) = ({B}, >= 1), got "
                             f"{tuple(block_table.shape)}")
        shape = DecodeShape(B, H, H_kv, Tq, D, block_table.shape[1] * slots, page_size=slots, num_pages=n0, D_v=D_v)
    if cache_seqlens is not None:
        check_tensor("cache_seqlens", cache_seqlens, rank=1, dtypes=(torch.int32,))
        check_values_in_memory("cache_seqlens", cache_seqlens)
        if cache_seqlens.device != query.device:
            raise ValueError(f"cache_seqlens is on {cache_seqlens.device} but query is on {query.device}")
        if cache_seqlens.shape[0] != B:
            raise ValueError(f"cache_seqlens must have B = {B} entries, got {cache_seqlens.shape[0]}")
    elif shape.capacity < Tq:
        raise ValueError(f"the cache holds {shape.capacity} keys but query has {Tq} new tokens, whose keys the "
                         "cache must already hold")
    if check_values:
        check_decode_values(shape, cache_seqlens, block_table)
    return shape


def check_decode_values(shape: DecodeShape, cache_seqlens, block_table) -> None:
    """The value checks: lengths 0 or in [Tq, capacity]; block table entries in the page pool.

    ``tolist`` reads a tensor through its strides and offset (a strided, transposed or expanded view gives
    its own values, never its raw neighbours), as the kernels do."""
    lengths = [shape.capacity] * shape.B if cache_seqlens is None else cache_seqlens.tolist()
    for b, n in enumerate(lengths):
        if n != 0 and not shape.Tq <= n <= shape.capacity:
            raise ValueError(
                f"cache_seqlens[{b}] = {n}: each length must be 0 (an empty slot) or in [Tq, capacity] = "
                f"[{shape.Tq}, {shape.capacity}] (the new tokens' own keys are part of the cache; the capacity is "
                + ("T_max)" if shape.page_size is None else "max_pages * page_size)")
            )
    if block_table is None:
        return
    table = block_table.tolist()
    for b, n in enumerate(lengths):
        used = -(-n // shape.page_size)  # pages that hold keys 0 .. n - 1
        for j, page in enumerate(table[b][:used]):
            if not 0 <= page < shape.num_pages:
                raise ValueError(f"block_table[{b}, {j}] = {page} is outside the page pool [0, {shape.num_pages}) "
                                 f"(sequence {b} has {n} keys, so its first {used} entries are read)")


def check_num_splits(num_splits) -> int | None:
    """None (let the split heuristic choose) or an int from 1 to MAX_SPLITS."""
    if num_splits is None:
        return None
    num_splits = check_int("num_splits", num_splits)
    if num_splits > MAX_SPLITS:
        raise ValueError(f"num_splits must be at most {MAX_SPLITS}, got {num_splits}")
    return num_splits


# --- masks beyond causal: sliding windows, soft-capping and packed documents ----------------------------

UNBOUNDED = -1  # a window side of -1 leaves that side unbounded (FlashAttention's window_size convention)
# The longest window side passed on: no tensor dimension comes near it, so a side this long already keeps every
# key on its side, as any longer one would; longer sides (Python ints have no limit, the ops' schemas stop at
# int64) are clamped to it, which changes no answer and leaves room for the band arithmetic in int64.
MAX_WINDOW_SIDE = 2**62


def check_window(window) -> tuple[int, int] | None:
    """None, or a pair (left, right) of ints, each -1 (unbounded) or >= 0: query i sees keys
    i - left .. i + right (shifted by the alignment's offset when Tq != Tk). A side beyond
    ``MAX_WINDOW_SIDE`` comes back as ``MAX_WINDOW_SIDE``: the same keys, in a size every tier takes."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be None or a pair (left, right) of ints, got {type(window).__name__} {window!r}")
    sides = []
    for name, side in zip(("window[0] (left)", "window[1] (right)"), window):
        if isinstance(side, (bool, np.bool_)) or not isinstance(side, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(side).__name__} {side!r}")
        if int(side) < UNBOUNDED:
            raise ValueError(f"{name} must be -1 (unbounded) or an int >= 0, got {side}")
        sides.append(min(int(side), MAX_WINDOW_SIDE))
    return sides[0], sides[1]


def check_softcap(softcap, dtype: torch.dtype | None = None) -> float | None:
    """None (no soft-capping), or the cap s > 0 of s * tanh(x / s), a finite real number.

    With ``dtype`` given, a cap that float32 arithmetic would round to 0 or to inf is refused for every
    dtype but float64 (the scores of 16-bit and float32 inputs are float32)."""
    if softcap is None:
        return None
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a positive real number or None, got {type(softcap).__name__} {softcap!r}")
    value = real_to_float("softcap", softcap)
    if not is_finite(value) or value <= 0:
        raise ValueError(f"softcap must be a positive finite number (the cap s of s * tanh(x / s)) or None, got "
                         f"{value}")
    tiny = torch.finfo(torch.float32).tiny
    if dtype is not None and dtype != torch.float64 and not tiny <= value <= FLOAT32_MAX:
        raise ValueError(f"softcap must lie in [{tiny:.3e}, {FLOAT32_MAX:.3e}] for {_dtype_name(dtype)} inputs (the "
                         f"scores are float32), got {value:.3e}; use float64 inputs for such a cap")
    return value


def check_cumulative_lengths(name: str, values) -> list[int]:
    """Cumulative lengths as a sequence of ints: [0, n_1, n_1 + n_2, ...], at least 2 entries,
    non-decreasing (an empty document is allowed)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    values = [check_int(f"{name}[{d}]", x, minimum=0) for d, x in enumerate(values)]
    if len(values) < 2:
        raise ValueError(f"{name} must hold at least 2 entries (0 and the total), got {values}")
    if values[0] != 0:
        raise ValueError(f"{name}[0] must be 0 (the first document starts at token 0), got {values[0]}")
    for d in range(len(values) - 1):
        if values[d + 1] < values[d]:
            raise ValueError(f"{name} must be non-decreasing, but {name}[{d + 1}] = {values[d + 1]} < "
                             f"{name}[{d}] = {values[d]}")
    return values


def check_cu_seqlens(name: str, cu_seqlens, total: int, device) -> list[int]:
    """Cumulative lengths of packed documents: a 1-D int32 tensor [0, n_1, n_1 + n_2, ..., total],
    non-decreasing (an empty document is allowed), on ``device``. Returns it as a list of ints, read
    through its strides."""
    check_tensor(name, cu_seqlens, rank=1, dtypes=(torch.int32,))
    check_values_in_memory(name, cu_seqlens)
    if cu_seqlens.device != device:
        raise ValueError(f"{name} is on {cu_seqlens.device} but the tokens are on {device}; they must match")
    if cu_seqlens.is_meta:
        raise ValueError(f"{name} is a meta tensor, which holds no values: the packed documents' lengths are "
                         "read on the host, so the tokens and their cu_seqlens must be CPU or CUDA tensors")
    values = check_cumulative_lengths(name, host_values(cu_seqlens))
    if values[-1] != total:
        raise ValueError(f"{name}[-1] = {values[-1]} must equal the number of packed tokens, {total}")
    return values


def check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, *, names=("q", "k", "v")):
    """Packed documents: q (total_q, H, D), k (total_k, H_kv, D) and v (total_k, H_kv, d_v), d_v from 1 to
    ``MAX_HEAD_DIM`` (``check_value``), and their cumulative lengths (one entry more than there are
    documents, the same number for queries and keys). Returns (H, H_kv, D, documents) with documents a
    list of ((q_start, q_end), (k_start, k_end)); d_v is v.shape[2]."""
    nq, nk, nv = names
    for name, t in ((nq, q), (nk, k), (nv, v)):
        check_tensor(name, t, rank=3)
        check_values_in_memory(name, t)
        if t.numel() == 0 and not (t is v and v.shape[-1] == 0):  # a d_v of 0: ``check_value``, below
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)}); every dimension must be at least 1")
    check_same(nk, k, nq, q)
    check_same(nv, v, nq, q)
    total_q, H, D = q.shape
    total_k, H_kv, Dk = k.shape
    if Dk != D:
        raise ValueError(f"{nk} has head dim {Dk} but {nq} has {D}; the head dim (dim 2) must match")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"{nq} has head dim {D}; flashtile supports head dims 1 to {MAX_HEAD_DIM} on every tier")
    check_value(v, k, names=(nk, nv), dims=("tokens", "key/value heads"))
    if H % H_kv != 0:
        raise ValueError(f"{nq} has {H} heads but {nk} and {nv} have {H_kv}; the number of query heads must be a "
                         "multiple of the number of key/value heads (GQA/MQA)")
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, q.device)
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, q.device)
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_seqlens_q describes {len(cu_q) - 1} documents but cu_seqlens_k {len(cu_k) - 1}; "
                         "every document has its queries and its keys")
    documents = [((cu_q[d], cu_q[d + 1]), (cu_k[d], cu_k[d + 1])) for d in range(len(cu_q) - 1)]
    return H, H_kv, D, documents


def check_max_seqlen(name: str, value, longest: int) -> int:
    """max_seqlen_q or max_seqlen_k of packed documents: an int at least the longest document's length
    (the kernels' grid is sized by it: a smaller one would leave tokens without a program)."""
    value = check_int(name, value, minimum=0)
    if value < longest:
        raise ValueError(f"{name} must be at least the longest document's length, {longest}, got {value}")
    return value


def host_values(x: torch.Tensor) -> list:
    """``x.tolist()``, read from the device once per unchanged tensor (``remember_fact``).

    Called once per attention layer on the same cu_seqlens, a read every call would drain the GPU's queue
    at every layer. Values written behind PyTorch's back are not seen: the checks are then those of the
    first read; the varlen kernels clamp every document to the packed tensors' tokens
    (``kernels._jit.varlen_program``), so such values can never make them read or write outside the tensors.
    CPU tensors, and calls under ``torch.compile``, read every time.
    """
    if x.device.type == "cpu" or torch.compiler.is_compiling():
        return x.tolist()
    values = recall_fact("values", x)
    if values is None:
        values = x.tolist()
        remember_fact("values", x, values)
    return values
