"""A measured probe, not part of the package: which rounding of FP8 attention carries its error on outlier inputs.

The float64 emulation (``flashtile.reference.fp8.fp8_attention_forward``) rounds four things: q, k and v
(by ``flashtile.fp8.quantize``) and P (before the PV product). This probe keeps a copy of that emulation
with each rounding as a switch, so that a term can be switched off while the others stay exactly as the
package does them: q "not rounded" means the same scaled (and, with the rotation, rotated) values
``x / descale`` before ``to_e4m3``, the same factors, the same V ratios on P. With every switch on the copy
is checked against the package's emulation (to float64 rounding) before any number is written.

Rows per cell (inputs, D, mask, seed, granularity of q and k, of v, rotation): ``rounded`` names what is
rounded: "qkvp" (the emulation), each of "q", "k", "v", "p" alone, and each left out ("kvp" = all but q,
...). ``rmse`` is against float64 attention of the original inputs, over every entry of o.

CPU only, float64 (about eight minutes on two cores):

    PYTHONPATH=src python bench/probes/fp8/fp8_error_split.py bench/results/sweeps/fp8-error-split.json
"""

from __future__ import annotations

import sys

import torch
from fp8_error import BLOCK, SEEDS, B, H, T, draw, rmse, save_cpu_result  # the first probe's inputs and output

from flashtile.fp8 import hadamard_rotation, quantize
from flashtile.reference.fp8 import E4M3_MAX, P_SCALE, fp8_attention_forward, to_e4m3
from flashtile.reference.naive import naive_attention
from flashtile.reference.online_softmax import safe_exp_diff

# (granularity of q and k, of v, rotate q and k): the issue's baseline, its target setting, FlashAttention-3's
# (v per head), and the rotation per tensor
SETTINGS = (("tensor", "tensor", False), ("block", "block", True), ("block", "head", True), ("tensor", "tensor", True))
ROUNDED = ("qkvp", "q", "k", "v", "p", "kvp", "qvp", "qkp", "qkv")
METHOD = (
    "RMSE of FP8 attention's float64 emulation with some of its four roundings (q, k, v, P) switched off; CPU, "
    "float64: rmse = sqrt(mean((o - o_exact)^2)), o_exact = naive_attention of the original float64 inputs. "
    "'rounded' lists the roundings kept; a value not rounded is the same scaled value x / descale (after the "
    "rotation, if any) before to_e4m3, with the same factors and the same V ratios on P. Outlier inputs: "
    f"N(0, 1) with 0.1 % of entries redrawn from N(0, 10^2); B = {B}, H = H_kv = {H}, T = {T}, block = {BLOCK}, "
    f"block_k = {BLOCK}, seeds {SEEDS}"
)


def scaled(x: torch.Tensor, granularity: str, rotate: bool):
    """(x8 as float64, x / descale unrounded, descale float64): quantize's codes and what they round."""
    x8, descale = quantize(x, granularity, rotate=rotate, block=BLOCK if granularity == "block" else None)
    x = x @ hadamard_rotation(x.shape[-1]) if rotate else x
    return x8.double(), x / descale.double()[..., None], descale.double()


def emulation(q, k, v_codes, descale_v, causal, round_p):
    """The package's emulation (H = H_kv, upper-left, τ = 1/sqrt(D)) on q, k values and V codes as given."""
    scale = q.shape[-1] ** -0.5
    v_scale = descale_v.amax(dim=-1, keepdim=True)  # (B, H, 1)
    v_ratio = descale_v / v_scale
    i = torch.arange(T)[:, None]
    m = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float64)
    l = torch.zeros_like(m)
    acc = torch.zeros_like(q)
    for k_start in range(0, T, BLOCK):
        s = scale * (q @ k[..., k_start:k_start + BLOCK, :].transpose(-1, -2))
        if causal:
            s = s.masked_fill(torch.arange(k_start, k_start + BLOCK)[None, :] > i, float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1))
        alpha = safe_exp_diff(m, m_new)
        p = safe_exp_diff(s, m_new[..., None])
        l = alpha * l + p.sum(dim=-1)
        p8 = p * v_ratio[..., None, k_start:k_start + BLOCK] * P_SCALE
        p8 = to_e4m3(p8).double() if round_p else p8
        acc = alpha[..., None] * acc + p8 @ v_codes[..., k_start:k_start + BLOCK, :]
        m = m_new
    return acc * (v_scale[..., None] / E4M3_MAX) / l[..., None]


def rows_for(kind: str, D: int, causal: bool, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed * 1000 + D + 2 * causal + (kind == "outliers"))
    q, k, v = (draw(kind, D, gen) for _ in range(3))
    o_exact, _ = naive_attention(q, k, v, causal)
    shape = dict(B=B, H=H, H_kv=H, Tq=T, Tk=T, D=D, causal=causal, layout="bhtd", inputs=kind, seed=seed)
    rows = []
    for granularity, v_granularity, rotate in SETTINGS:
        (q8, q_exact, dq), (k8, k_exact, dk) = (scaled(x, granularity, rotate) for x in (q, k))
        v8, v_exact, dv = scaled(v, v_granularity, False)
        o_package, _ = fp8_attention_forward(*(x8.to(torch.float8_e4m3fn) for x8 in (q8, k8, v8)),
                                             dq.float(), dk.float(), dv.float(), causal, None, BLOCK)  # fmt: skip
        for rounded in ROUNDED:
            o = emulation((q8 if "q" in rounded else q_exact) * dq[..., None],
                          (k8 if "k" in rounded else k_exact) * dk[..., None],
                          v8 if "v" in rounded else v_exact, dv, causal, "p" in rounded)  # fmt: skip
            if rounded == "qkvp":  # the copy is the package's emulation, or no number of it means anything
                torch.testing.assert_close(o, o_package, rtol=1e-12, atol=1e-12)
            rows.append({"pass": "forward", "provider": "flashtile_fp8_emulation", **shape, "dtype": "fp8_e4m3",
                         "ms": None, "tflops": None, "error": "not timed: an accuracy study of the float64 emulation",
                         "granularity": granularity, "v_granularity": v_granularity, "rotate": rotate,
                         "rounded": rounded, "rmse": rmse(o, o_exact)})  # fmt: skip
        print(kind, D, causal, seed, granularity, v_granularity, rotate,
              " ".join(f"{r['rounded']}={r['rmse']:.2e}" for r in rows[-len(ROUNDED):]), flush=True)  # fmt: skip
    return rows


def main(out: str) -> None:
    torch.set_num_threads(1)
    rows = [row for D in (64, 128) for causal in (False, True) for seed in SEEDS
            for row in rows_for("outliers", D, causal, seed)]  # fmt: skip
    save_cpu_result(out, rows, METHOD)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fp8-error-split.json")
