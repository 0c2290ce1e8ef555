"""The roofline of attention: FLOPs against the bytes that must cross HBM, and the two ceilings of one GPU.

A kernel cannot finish before its FLOPs are done at the matmul rate P, nor before its bytes are moved
at the copy rate W, so ``roofline_ms`` = max(FLOPs / P, bytes / W) is a lower bound on its time. The
FLOPs are the tables' convention (``common.attention_flops``); the bytes here are the least any exact
attention moves: Q, K, V read once and O written once. The ceilings are the H200's, measured by matmul
and copy benchmarks and committed in ``bench/results/ceilings.json`` with their provenance.
"""

from __future__ import annotations

import json

from .common import RESULTS, attention_flops

BYTES_PER_ELEMENT = {"bf16": 2, "fp16": 2, "fp32": 4}


def load_ceilings(path=RESULTS / "ceilings.json") -> dict:
    """``{"tflops": P, "tbps": W}``: the bf16 matmul rate and the copy rate (read + write) of the GPU."""
    raw = json.loads(path.read_text())["ceilings"]
    return {"tflops": raw["matmul_bf16_tflops_8192cube"], "tbps": raw["device_copy_TBps_read_plus_write"]}


# --8<-- [start:roofline]
def attention_bytes(shape: dict) -> int:
    """Bytes of Q and O (B, H, Tq, D) and K and V (B, H_kv, Tk, D), each crossing HBM
    once."""
    elements = (
        shape["B"]
        * shape["D"]
        * (2 * shape["H"] * shape["Tq"] + 2 * shape["H_kv"] * shape["Tk"])
    )
    return BYTES_PER_ELEMENT[shape["dtype"]] * elements


def arithmetic_intensity(shape: dict) -> float:
    """FLOPs per byte of HBM traffic, at the least traffic."""
    return attention_flops(shape) / attention_bytes(shape)


def ridge_intensity(ceilings: dict) -> float:
    """The intensity at which moving the bytes and doing the FLOPs take equally long: P
    / W."""
    return ceilings["tflops"] / ceilings["tbps"]


def roofline_ms(shape: dict, ceilings: dict) -> float:
    """The least time for ``shape``: compute-bound above the ridge, memory-bound below
    it."""
    compute_s = attention_flops(shape) / (ceilings["tflops"] * 1e12)
    memory_s = attention_bytes(shape) / (ceilings["tbps"] * 1e12)
    return 1e3 * max(compute_s, memory_s)
# --8<-- [end:roofline]


def standard_attention_intensity(T: int, d: int, dtype: str = "bf16") -> float:
    """FLOPs per byte of unfused attention (S and P written to HBM and read back), one square causal-free head.

    The traffic is ``reference.io_model.standard_attention_traffic``: 4Td + 4T² elements.
    """
    from ..reference.io_model import standard_attention_traffic

    flops = 4 * T * T * d
    return flops / (BYTES_PER_ELEMENT[dtype] * standard_attention_traffic(T, d).total)
