"""The forward benchmark's shape sets, as plain dicts with the bench schema's shape fields.

A shape is ``dict(B, H, H_kv, Tq, Tk, D, causal, layout, dtype)``: the fields every row of
``bench/results/forward*.json`` repeats (BENCH_SCHEMA.md). ``layout`` is ``bhtd`` (a contiguous
(B, H, T, D) tensor) or ``bthd`` (a transposed view of a contiguous (B, T, H, D) tensor, as a model's
projections produce). Each set below is written to its own file by ``python -m flashtile.bench forward``:

=========  ===================================  ==========================================================
set        file                                 shapes
=========  ===================================  ==========================================================
main       ``forward.json``                     the seed shape, then the standard sweep in bf16
fp16       ``forward-fp16.json``                the standard sweep at D = 128 in fp16
models     ``forward-models.json``              GQA, ``bthd``, small B·H and D = 256, bf16, causal
scaleup    ``forward-scaleup.json``             B = 8, H = 16, D = 64, causal, T = 256 .. 32k, bf16 (the lab's)
d256       ``forward-d256.json``                D = 256 (Gemma's head size): B·T = 16,384, H = 8, T 2k-8k, both masks
=========  ===================================  ==========================================================
"""

from __future__ import annotations

SHAPE_KEYS = ("B", "H", "H_kv", "Tq", "Tk", "D", "causal", "layout", "dtype")
LAYOUTS = ("bhtd", "bthd")
DTYPES = ("bf16", "fp16", "fp32")

# The standard sweep of BENCH_SCHEMA.md (the FlashAttention papers' convention): B*T and H*D held fixed.
TOKENS, WIDTH = 16384, 2048
STANDARD_T = (512, 1024, 2048, 4096, 8192, 16384)
STANDARD_D = (64, 128)


def shape(B: int, H: int, T: int, D: int, causal: bool, *, H_kv: int | None = None, layout: str = "bhtd",
          dtype: str = "bf16") -> dict:  # fmt: skip
    """One square (Tq = Tk = T) shape; ``H_kv`` defaults to H (multi-head attention)."""
    H_kv = H if H_kv is None else H_kv
    if H % H_kv:
        raise ValueError(f"H must be a multiple of H_kv, got H={H}, H_kv={H_kv}")
    if layout not in LAYOUTS or dtype not in DTYPES:
        raise ValueError(f"layout must be one of {LAYOUTS} and dtype one of {DTYPES}, got {layout!r}, {dtype!r}")
    return dict(B=B, H=H, H_kv=H_kv, Tq=T, Tk=T, D=D, causal=causal, layout=layout, dtype=dtype)


def standard_sweep(dtype: str = "bf16", head_dims=STANDARD_D) -> list[dict]:
    """B*T = 16,384 and H*D = 2,048 at every T of the sweep and every D, causal first; bhtd, H_kv = H."""
    return [
        shape(TOKENS // T, WIDTH // D, T, D, causal, dtype=dtype)
        for D in head_dims
        for T in STANDARD_T
        for causal in (True, False)
    ]


def is_standard(s: dict) -> bool:
    """Whether ``s`` is a cell of the standard sweep (any dtype)."""
    return (s["B"] * s["Tq"] == TOKENS and s["H"] * s["D"] == WIDTH and s["Tq"] == s["Tk"] and s["H_kv"] == s["H"]
            and s["layout"] == "bhtd" and s["Tq"] in STANDARD_T and s["D"] in STANDARD_D)  # fmt: skip


# The shape the project's first forward table was built around (the example).
SEED = shape(8, 16, 2048, 64, True)


def model_shapes() -> list[dict]:
    """Shapes models use that the standard sweep leaves out: GQA, the bthd layout, few heads, D = 256."""
    both = lambda **kw: [shape(**kw, layout=layout) for layout in LAYOUTS]
    return [
        *both(B=2, H=16, H_kv=4, T=2048, D=64, causal=True),  # a small Llama-style model: GQA 16/4
        *both(B=2, H=16, H_kv=16, T=2048, D=64, causal=True),  # the same without GQA
        *both(B=1, H=32, H_kv=8, T=8192, D=128, causal=True),  # Llama-3-8B-style heads, one long sequence
        *both(B=4, H=32, H_kv=8, T=4096, D=128, causal=True),
        shape(1, 16, 4096, 128, True),  # few heads: 16 (batch, head) pairs, 32 query tiles of 128 rows each
        shape(4, 16, 4096, 256, True),  # the largest head dim the kernels take (the old table's last row)
    ]


SCALEUP_T = tuple(2**k for k in range(8, 16))  # 256 .. 32,768


def scaleup_shapes() -> list[dict]:
    """The lab's shape (the seed's B, H, D and mask) at growing T: the plot where materialising the scores
    falls off, then runs out of memory."""
    return [shape(SEED["B"], SEED["H"], T, SEED["D"], SEED["causal"]) for T in SCALEUP_T]


D256_T = (2048, 4096, 8192)


def head_dim_256_shapes() -> list[dict]:
    """The largest head dim the kernels take, as Gemma-family models use it: B·T = 16,384 tokens, H = 8,
    T = 2k, 4k and 8k, without a mask and causal."""
    return [shape(TOKENS // T, 8, T, 256, causal) for T in D256_T for causal in (False, True)]


# set name -> (result file under bench/results, shapes)
SETS = {
    "main": ("forward.json", lambda: [SEED, *standard_sweep("bf16")]),
    "fp16": ("forward-fp16.json", lambda: standard_sweep("fp16", head_dims=(128,))),
    "models": ("forward-models.json", model_shapes),
    "scaleup": ("forward-scaleup.json", scaleup_shapes),
    "d256": ("forward-d256.json", head_dim_256_shapes),
}


def describe(s: dict) -> str:
    """A short label for progress lines: 'B=8 H=16 T=2048 D=64 causal bf16 bhtd' (H=32/8 for GQA)."""
    heads = f"H={s['H']}" if s["H_kv"] == s["H"] else f"H={s['H']}/{s['H_kv']}"
    T = f"T={s['Tq']}" if s["Tq"] == s["Tk"] else f"Tq={s['Tq']} Tk={s['Tk']}"
    return f"B={s['B']} {heads} {T} D={s['D']} {'causal' if s['causal'] else 'full'} {s['dtype']} {s['layout']}"
