"""The forward providers the tables compare, the inputs they share and the float32 truth they are checked against.

Every provider is a function ``(q, k, v) -> o`` for q (B, H, Tq, D) and k, v (B, H_kv, Tk, D) in the
shape's layout, returning o (B, H, Tq, D) in the inputs' dtype (any strides):

- ``flashtile``: the Triton launcher ``kernels.forward.flash_attention`` (GQA natively, any strides),
  with a launch config when the benchmark asks for one;
- ``flashtile_textbook``: ``kernels.textbook.textbook_forward``, the chapters' first kernel (fixed tiles,
  pointer loads); skipped (``Skip``) at GQA shapes and head dims above 128, which it does not take;
- ``sdpa_cudnn``, ``sdpa_flash``, ``sdpa_efficient``, ``sdpa_math``: PyTorch's
  ``scaled_dot_product_attention`` pinned to one backend with ``torch.nn.attention.sdpa_kernel``
  (``enable_gqa=True`` where H_kv < H); a backend that refuses a shape raises, and the row says why;
- ``flex``: ``torch.nn.attention.flex_attention`` compiled by ``torch.compile`` for each shape, with a
  causal block mask where the shape is causal;
- ``naive``: softmax(Q Kᵀ τ) V in plain PyTorch, the (B, H, Tq, Tk) scores materialised;
- ``flashtile_fp8`` (not in the default list: ``--providers`` names it): ``flashtile.attention`` on E4M3
  copies of the inputs, ``flashtile.fp8.quantize`` per head (V keys-contiguous, the layout the FP8 kernel
  reads), o in bf16. The copies are made once per set of inputs, outside the timing, as a model that keeps
  its cache in FP8 would; its rows say ``dtype: fp8_e4m3`` and are checked with ``TOLERANCE["fp8_e4m3"]``.

``sdpa_math`` is skipped (``Skip``) where its float32 scores would exceed ``MATH_BUDGET_BYTES``; the
naive provider is never skipped, so that the scale-up table shows where it runs out of memory.
"""

from __future__ import annotations

import math

import torch

DEFAULT_PROVIDERS = ("flashtile", "flashtile_textbook", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math",
                     "flex", "naive")  # fmt: skip
PROVIDERS = (*DEFAULT_PROVIDERS, "flashtile_fp8")
PROVIDER_DTYPES = {"flashtile_fp8": "fp8_e4m3"}  # a provider that computes in another dtype than its inputs'
SDPA_BACKENDS = {
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_math": "MATH",
}
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MATH_BUDGET_BYTES = 8 * 2**30  # the math backend's float32 (B, H, Tq, Tk) scores must fit in 8 GiB

# A provider passes when both its largest error and its error relative to the truth's size are small.
# Relative: at T = 16k without a mask every output row is an average of 16k values, so |o| is ~0.01 and
# an absolute bound alone would let a wrong scale or a missing mask through.
# FP8: E4M3 keeps 3 mantissa bits, so each input carries up to 2^-4 = 6.25 % relative error, and o about that
# (docs/part-c/fp8.md derives it); 10 % relative L2 still refuses a wrong scale, mask or factor, which give O(1)
TOLERANCE = {"bf16": (5e-2, 2e-2), "fp16": (1e-2, 5e-3), "fp32": (1e-3, 1e-4),
             "fp8_e4m3": (0.5, 0.1)}  # (max abs, relative L2)  # fmt: skip


class Skip(Exception):
    """A provider deliberately not run at a shape; the message becomes the row's ``error``."""


class WrongAnswer(AssertionError):
    """A provider whose output disagrees with the float32 truth: never timed, never recorded."""


def make_inputs(shape: dict, device="cuda", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of ``shape``: standard normal, in its dtype and layout (never zeros: they can time faster)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = TORCH_DTYPES[shape["dtype"]]

    def one(heads, T):
        if shape["layout"] == "bthd":  # what a model's projection gives: (B, T, H, D) memory, viewed as (B, H, T, D)
            x = torch.randn(shape["B"], T, heads, shape["D"], generator=gen, device=device, dtype=dtype)
            return x.transpose(1, 2)
        return torch.randn(shape["B"], heads, T, shape["D"], generator=gen, device=device, dtype=dtype)

    return one(shape["H"], shape["Tq"]), one(shape["H_kv"], shape["Tk"]), one(shape["H_kv"], shape["Tk"])


def reference_output(q, k, v, causal: bool, chunk_elements: int = 2**28) -> torch.Tensor:
    """softmax(Q Kᵀ / sqrt(D)) V in float32, (B, H, Tq, D), computed a block of query rows at a time.

    Blocks hold at most ``chunk_elements`` float32 scores, so the truth fits in memory at shapes where the
    naive provider does not. Causal is upper-left (query i sees keys 0..i), as in SDPA's ``is_causal``.
    TF32 is switched off for the call: the truth must be float32 arithmetic.
    """
    B, H, Tq, D = q.shape
    H_kv, Tk = k.shape[1], k.shape[2]
    rows = max(1, chunk_elements // (H * Tk))
    out = torch.empty(B, H, Tq, D, dtype=torch.float32, device=q.device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for b in range(B):
            kb = k[b].float().repeat_interleave(H // H_kv, dim=0)  # (H, Tk, D)
            vb = v[b].float().repeat_interleave(H // H_kv, dim=0)
            for start in range(0, Tq, rows):
                stop = min(Tq, start + rows)
                s = q[b, :, start:stop].float() @ kb.transpose(1, 2) / math.sqrt(D)  # (H, rows, Tk)
                if causal:
                    i = torch.arange(start, stop, device=q.device)[:, None]
                    s = s.masked_fill(torch.arange(Tk, device=q.device)[None, :] > i, float("-inf"))
                out[b, :, start:stop] = torch.softmax(s, dim=-1) @ vb
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return out


def check_output(name: str, o: torch.Tensor, truth: torch.Tensor, dtype: str) -> float:
    """The largest |o - truth|; raises ``WrongAnswer`` if it, or the relative L2 error, is over ``TOLERANCE``."""
    if tuple(o.shape) != tuple(truth.shape):
        raise WrongAnswer(f"{name} returned shape {tuple(o.shape)}, expected {tuple(truth.shape)}")
    diff = o.float() - truth
    max_abs = diff.abs().max().item()
    relative = (diff.norm() / truth.norm().clamp_min(1e-30)).item()
    max_abs_tol, rel_tol = TOLERANCE[dtype]
    if not (max_abs <= max_abs_tol and relative <= rel_tol):  # also catches NaN
        raise WrongAnswer(
            f"{name} disagrees with the float32 truth: max |error| {max_abs:.3g} (allowed {max_abs_tol}), "
            f"relative L2 error {relative:.3g} (allowed {rel_tol})"
        )
    return max_abs


# --8<-- [start:naive]
def naive_attention(q, k, v, causal: bool) -> torch.Tensor:
    """softmax(Q Kᵀ τ) V as three PyTorch operations, in the inputs' dtype."""
    group = q.shape[1] // k.shape[1]
    if group > 1:  # GQA: every query head of a group reads the same K, V head
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    Tq, Tk = q.shape[2], k.shape[2]
    # (B, H, Tq, Tk): the matrix FlashAttention never writes
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(
            torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).triu(1), float("-inf")
        )
    # a second (B, H, Tq, Tk) tensor, while s is still alive
    p = torch.softmax(s, dim=-1)
    return p @ v
# --8<-- [end:naive]


def math_scores_bytes(shape: dict) -> int:
    """Bytes of the float32 (B, H, Tq, Tk) scores SDPA's math backend forms (it computes 16-bit inputs in fp32)."""
    return 4 * shape["B"] * shape["H"] * shape["Tq"] * shape["Tk"]


def textbook_skip(shape: dict) -> str | None:
    """Why the textbook kernels do not run ``shape`` (a row's ``error``), or None where they do."""
    from ..kernels.textbook import TEXTBOOK_MAX_HEAD_DIM

    if shape["H_kv"] != shape["H"]:
        return "skipped: the textbook kernel has no GQA"
    if shape["D"] > TEXTBOOK_MAX_HEAD_DIM:
        return f"skipped: the textbook kernel takes head dims up to {TEXTBOOK_MAX_HEAD_DIM}"
    return None


def _sdpa(backend_name: str, causal: bool, gqa: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    return run


def _flex(shape: dict, device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()  # one fresh compile per shape, so no shape runs into dynamo's recompile limit
    compiled = torch.compile(flex_attention, dynamic=False)
    mask = None
    if shape["causal"]:
        mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, shape["Tq"], shape["Tk"],
                                 device=device)  # fmt: skip
    gqa = shape["H_kv"] != shape["H"]
    return lambda q, k, v: compiled(q, k, v, block_mask=mask, enable_gqa=gqa)


def _fp8(causal: bool, gqa: bool):
    from ..api import attention
    from ..fp8 import quantize

    kept = {}  # the E4M3 copies of the last inputs: quantised once, not on every timed call

    def run(q, k, v):
        if any(a is not b for a, b in zip(kept.get("inputs", ()), (q, k, v))) or not kept:  # other tensors
            (q8, dq), (k8, dk), (v8, dv) = (quantize(x, "head", keys_contiguous=x is v) for x in (q, k, v))
            kept.update(inputs=(q, k, v), args=(q8, k8, v8), factors=dict(descale_q=dq, descale_k=dk, descale_v=dv))
        return attention(*kept["args"], is_causal=causal, enable_gqa=gqa, out_dtype=q.dtype, **kept["factors"])

    return run


def provider_dtype(name: str, shape: dict) -> str:
    """The dtype a provider computes in: its inputs' (the shape's), or FP8's for ``flashtile_fp8``."""
    return PROVIDER_DTYPES.get(name, shape["dtype"])


def build(name: str, shape: dict, device="cuda", launch: dict | None = None):
    """The provider ``name`` for ``shape`` as a function (q, k, v) -> o; raises ``Skip`` where it is not run.

    ``launch`` (block_q, block_k, num_warps, num_stages) goes to flashtile's launcher only.
    """
    causal, gqa = shape["causal"], shape["H_kv"] != shape["H"]
    if name == "flashtile":
        from ..kernels.forward import flash_attention

        launch = dict(launch or {})
        return lambda q, k, v: flash_attention(q, k, v, causal=causal, **launch)[0]
    if name == "flashtile_textbook":
        from ..kernels.textbook import textbook_forward

        if textbook_skip(shape):
            raise Skip(textbook_skip(shape))
        return lambda q, k, v: textbook_forward(q, k, v, causal)[0]
    if name == "sdpa_math" and math_scores_bytes(shape) > MATH_BUDGET_BYTES:
        raise Skip(f"skipped: fp32 scores {math_scores_bytes(shape) / 2**30:.0f} GiB > 8 GiB budget")
    if name in SDPA_BACKENDS:
        return _sdpa(SDPA_BACKENDS[name], causal, gqa)
    if name == "flex":
        return _flex(shape, device)
    if name == "naive":
        return lambda q, k, v: naive_attention(q, k, v, causal)
    if name == "flashtile_fp8":
        return _fp8(causal, gqa)
    raise ValueError(f"unknown provider {name!r}; known: {', '.join(PROVIDERS)}")
