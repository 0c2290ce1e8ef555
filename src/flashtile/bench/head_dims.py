"""Head-dims table: a value head dim smaller than the query/key one (DeepSeek's MLA prefill, 192/128),
against the same call with v padded to q's head dim and against SDPA's backends; forward and backward.

``python -m flashtile.bench head_dims`` writes ``bench/results/head-dims.json`` (``--out`` elsewhere;
``--cases`` to pick some of ``CASES``, ``--rounds`` rounds). Shapes: H = 16 heads (MHA), bf16, the
``bthd`` layout a model's projections give, causal, B·T = 16,384 tokens at T = 2k and 8k, for
d_qk/d_v = 192/128 (DeepSeek-V3: 128 + 64 rotary for q·k, 128 for v) and 128/64.

Providers (every row has ``D`` = d_qk and ``D_v``):

- ``flashtile``: ``flashtile.attention`` with v of d_v, o of d_v;
- ``flashtile_padded``: what model code does for kernels that need one head dim: v zero-padded to d_qk,
  the call, o cut back to d_v (the pad and the cut are timed, as they run in the model);
- ``flashtile_qk_pow2`` (where d_qk is no power of two, 192): q and k zero-padded to the next power of two
  (256) with the scale of d_qk, v as it is: the width a Triton tile's head dim has (``tl.arange`` spans a
  power of two), so its time beside ``flashtile``'s says how much of the q·k work is padding. The padding is
  made once, before the clock runs, in the model's layout: the kernel alone is timed;
- ``sdpa_cudnn``, ``sdpa_flash``, ``sdpa_efficient``: SDPA's backends given v of d_v as it is; a backend
  that refuses the shape gets rows that say so.

Every forward is checked against a float32 truth; every provider's gradients against flashtile's. FLOPs
are those of the unpadded call for every provider, 2·B·H·Tq·Tk·(d_qk + d_v), x0.5 causal, x2.5 backward,
so that a row's TFLOP/s compares the same work.
"""

from __future__ import annotations

import math

import torch

from .common import RESULTS
from .providers import _sdpa, make_inputs
from .rounds import Contender, main_for, outcome_rows, run_rounds
from .shapes import describe, shape

HEADS = 16
CASES = {  # name -> (B, T, d_qk, d_v)
    "192/128 2k": (8, 2048, 192, 128),
    "192/128 8k": (2, 8192, 192, 128),
    "128/64 2k": (8, 2048, 128, 64),
    "128/64 8k": (2, 8192, 128, 64),
}
SDPA = {"sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_flash": "FLASH_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION"}
ROUNDS = 3
METHOD = (
    "triton.testing.do_bench median (warmup 50 ms, rep 200 ms) per round, median of the rounds, providers "
    "taking turns each round; forward under no_grad, backward alone (o.backward(do, retain_graph=True)); "
    "TFLOP/s = 2*B*H*T*T*(D + D_v)*0.5 (x2.5 backward) / time for every provider, the padded one included; "
    "each forward checked against a float32 truth, gradients compared with flashtile's"
)


def causal_truth(q, k, v, rows: int = 512) -> torch.Tensor:
    """softmax(Q Kᵀ / sqrt(d_qk)) V in float32 (B, H, T, d_v), causal, a block of query rows at a time; TF32 off."""
    B, H, T, D = q.shape
    out = torch.empty(B, H, T, v.shape[-1], dtype=torch.float32, device=q.device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for start in range(0, T, rows):
            stop = min(T, start + rows)
            s = q[:, :, start:stop].float() @ k.float().transpose(-1, -2) / math.sqrt(D)
            i = torch.arange(start, stop, device=q.device)[:, None]
            s = s.masked_fill(torch.arange(T, device=q.device)[None, :] > i, float("-inf"))
            out[:, :, start:stop] = torch.softmax(s, dim=-1) @ v.float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return out


def pad_head_dim(x: torch.Tensor, width: int) -> torch.Tensor:
    """x (B, H, T, d), a view of (B, T, H, d) as the model's projections give it, zero-padded to ``width`` in
    that same layout (padding the view itself would give a contiguous (B, H, T, width) tensor: another
    layout for the kernel to read)."""
    return torch.nn.functional.pad(x.transpose(1, 2), (0, width - x.shape[-1])).transpose(1, 2)


def padded(q, k, v):
    """v zero-padded to q's head dim, one call, o cut back: one head dim for the kernel, d_v for the model.
    The copy is part of the time, as it is of the model that pads."""
    from ..api import attention

    d_v = v.shape[-1]
    return attention(q, k, pad_head_dim(v, q.shape[-1]), is_causal=True)[..., :d_v]


def qk_padded(d_qk: int):
    """The kernel on q and k already padded to the next power of two, the width the q·k tiles have anyway (a
    tile's head dim is a power of two); the scores, and with τ given, o are unchanged. The padding is made
    before the clock runs (``contenders``): what is timed is the kernel at that width alone."""
    from ..api import attention

    return lambda q_wide, k_wide, v: attention(q_wide, k_wide, v, is_causal=True, scale=d_qk**-0.5)


def contenders(q, k, v) -> dict:
    from ..api import attention

    names, truth = ("q", "k", "v"), causal_truth(q, k, v)
    found = {
        "flashtile": lambda q, k, v: attention(q, k, v, is_causal=True),
        "flashtile_padded": padded,
        **{name: _sdpa(backend, True, False) for name, backend in SDPA.items()},
    }
    cs = {name: Contender(fn, (q, k, v), names, dict(provider=name), truth) for name, fn in found.items()}
    d_qk = q.shape[-1]
    if d_qk & (d_qk - 1):  # not a power of two: what the kernel's padded q·k tiles cost
        wide = 1 << (d_qk - 1).bit_length()
        # its q and k gradients are wide: named apart, so that only v's is compared with flashtile's
        cs["flashtile_qk_pow2"] = Contender(qk_padded(d_qk), (pad_head_dim(q, wide), pad_head_dim(k, wide), v),
                                            ("q_wide", "k_wide", "v"), dict(provider="flashtile_qk_pow2"), truth)
    return cs


def measure_case(name: str, rounds: int = ROUNDS, device="cuda") -> list[dict]:
    B, T, d_qk, d_v = CASES[name]
    s = shape(B, HEADS, T, d_qk, True, layout="bthd")
    q, k, _ = make_inputs(s, device)
    v = make_inputs(dict(s, D=d_v), device, seed=1)[2]
    do = torch.randn(B, T, HEADS, d_v, device=q.device, dtype=q.dtype).transpose(1, 2)
    cs = contenders(q, k, v)
    outcomes = run_rounds(cs, do, "bf16", rounds=rounds, label=f"{name} {describe(s)}")
    flops = 2 * B * HEADS * T * T * (d_qk + d_v) * 0.5
    base = {**s, "D_v": d_v, "mask": "causal", "case": name}
    return outcome_rows(outcomes, cs, base, flops, compared={c: "flashtile" for c in cs if c != "flashtile"})


def main(argv=None) -> None:
    main_for("head_dims", __doc__, CASES, measure_case, RESULTS / "head-dims.json", ROUNDS, METHOD, argv)


if __name__ == "__main__":
    main()
