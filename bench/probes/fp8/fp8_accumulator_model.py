"""A CPU probe, not part of the package: how far a short accumulator and planted bugs move the FP8 forward.

The GPU test of the FP8 kernel (tests/kernels/test_fp8_forward.py) holds the kernel within 1.5 times the
distance from the float64 emulation that a model reaches: the emulation's steps with both dots summed one
product at a time in an accumulator of ``bits`` significant bits. This probe prints, for the test's
outlier case at D = 96 (no rotation) and for its exact-score inputs, that model's distance at 12, 13 and
14 bits, and the distance of three planted bugs (P not rounded to E4M3, one key too many under the
causal mask, l summing the rounded P), each as RMSE(o, o_emulation) over the emulation's own RMSE
against float64 attention of the original inputs (outlier case), or as the RMSE itself (exact scores),
with the bug in l shown by the largest change of lse. Everything runs in float64 on the CPU (a minute).

    PYTHONPATH=src python bench/probes/fp8/fp8_accumulator_model.py
"""

from __future__ import annotations

import math

import torch

from flashtile.fp8 import quantize
from flashtile.reference.fp8 import fp8_attention_forward, to_e4m3
from flashtile.reference.naive import naive_attention


def rounded_to(x, bits):
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.round(torch.ldexp(mantissa, torch.full_like(exponent, bits))), exponent - bits)


def forward(q8, k8, v8, dq, dk, dv, causal, offset, bits=None, bug=None, block_k=64):
    """(o, lse) of the FP8 forward in float64 with both dots in a ``bits``-bit accumulator and ``bug`` planted."""
    B, H, Tq, D = q8.shape
    group, Tk = H // k8.shape[1], k8.shape[2]
    q, k, v = q8.double(), k8.double().repeat_interleave(group, 1), v8.double().repeat_interleave(group, 1)
    dq, dk, dv = dq.double(), dk.double().repeat_interleave(group, 1), dv.double().repeat_interleave(group, 1)
    v_scale = dv.amax(-1, keepdim=True)
    i = torch.arange(Tq)[:, None] + offset + (1 if bug == "one key too many" else 0)
    m = torch.full((B, H, Tq), -math.inf, dtype=torch.float64)
    l, acc = torch.zeros_like(m), torch.zeros(B, H, Tq, D, dtype=torch.float64)
    for start in range(0, Tk, block_k):
        keys = slice(start, min(start + block_k, Tk))
        raw = torch.zeros(B, H, Tq, keys.stop - start, dtype=torch.float64)
        for d in range(D):
            raw = raw + q[..., d, None] * k[..., None, keys, d]
            raw = raw if bits is None else rounded_to(raw, bits)
        s = D**-0.5 * raw * dq[..., None] * dk[..., None, keys]
        if causal:
            s = s.masked_fill(torch.arange(start, keys.stop)[None, :] > i, -math.inf)
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
        alpha, p = torch.exp(m - m_safe), torch.exp(s - m_safe[..., None])
        ratio = (dv / v_scale)[..., None, keys]
        p8 = p * ratio * 448 if bug == "P not rounded" else to_e4m3(p * ratio * 448).double()
        l = alpha * l + (p8 / ratio / 448 if bug == "l of the rounded P" else p).sum(-1)
        pv = torch.zeros_like(acc)
        for j in range(keys.stop - start):
            pv = pv + p8[..., j, None] * v[..., start + j, None, :]
            pv = pv if bits is None else rounded_to(pv, bits)
        acc, m = alpha[..., None] * acc + pv, m_new
    empty = (l == 0)[..., None]
    o = torch.where(empty, 0.0, acc * (v_scale / 448)[..., None] / torch.where(empty, 1.0, l[..., None]))
    return o, m + torch.log(l)


def rmse(a, b):
    return (a - b).pow(2).mean().sqrt().item()


def report(name, args, causal, offset, scale_to):
    o_e, lse_e = fp8_attention_forward(*args, causal, None, 64, "upper_left" if offset == 0 else "lower_right")
    cells = [f"{name}:"]
    for bits in (12, 13, 14):
        cells.append(f"model {bits} bits {rmse(forward(*args, causal, offset, bits)[0], o_e) / scale_to:.3g}")
    for bug in ("P not rounded", "one key too many", "l of the rounded P"):
        o, lse = forward(*args, causal, offset, None, bug)
        seen = torch.isfinite(lse_e)
        cells.append(f"{bug} {rmse(o, o_e) / scale_to:.3g} (lse {(lse - lse_e)[seen].abs().max():.2g})")
    print(" | ".join(cells), flush=True)


def main():
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(len("tall-lower-right-d96") + 96)  # the GPU test's case and seed

    def outliers(T):
        x = torch.randn(1, 2 if T == 300 else 1, T, 96, generator=gen, dtype=torch.float64)
        pick = torch.rand(x.shape, generator=gen, dtype=torch.float64) < 1e-3
        return torch.where(pick, 10 * torch.randn(x.shape, generator=gen, dtype=torch.float64), x)

    q, k, v = outliers(300), outliers(200), outliers(200)
    for granularity in ("tensor", "head", "block"):
        (q8, dq), (k8, dk) = quantize(q, granularity), quantize(k, granularity)
        v8, dv = quantize(v, "head" if granularity == "block" else granularity)
        o_e, _ = fp8_attention_forward(q8, k8, v8, dq, dk, dv, True, None, 64, "lower_right")
        error = rmse(o_e, naive_attention(q, k, v, True, alignment="lower_right")[0])
        report(f"outliers D=96 {granularity} (over the emulation's error {error:.3g})",
               (q8, k8, v8, dq, dk, dv), True, -100, error)  # fmt: skip
    exact = torch.Generator().manual_seed(7)  # the exact-score test's inputs, smaller
    q8, k8 = (torch.randint(-3, 4, (1, 2, 300, 128), generator=exact).float().to(torch.float8_e4m3fn) for _ in "qk")
    dq, dk = (0.3 + 0.3 * torch.rand(1, 2, 300, generator=exact) for _ in "qk")
    v8, dv = quantize(torch.randn(1, 2, 300, 128, generator=exact, dtype=torch.float64), "block")
    for causal in (False, True):
        report(f"exact scores causal={causal} (absolute)", (q8, k8, v8, dq, dk, dv), causal, 0, 1.0)


if __name__ == "__main__":
    main()
