"""A measured probe, not part of the package: P in one multiply-add per score in both backward kernels.

The kernel split (``sweeps/backward-kernel-split.json``) puts the dK/dV kernel's own matmuls at 351-434 TFLOP/s at
D = 64 and the dQ kernel's at 484-613, and an earlier entry found the dK/dV loop bound by issued instructions. Each
score's P costs a subtract, a multiply-add and an exponential today: exp2((u - m) qk_scale - log2 l), exact at any
magnitude of the logits. With one bias per row, b = m qk_scale + log2 l, it is one multiply-add and the
exponential: exp2(u qk_scale - b), whose error grows with |m qk_scale| (the rounding of b), which is why the
package does not do it. This probe asks what the instruction would buy before anything is built for the
exactness: a copy of ``kernels/backward.py`` with that change in both loops (``fused``, loaded as its own module
as ``forward_ab.py`` loads its versions), timed beside the package
in interleaved rounds with cuDNN at D = 64, 128 (T 2k and 8k, causal and not) and D = 256 (8k), gradients
compared with the package's.

    OUT=/some/folder PYTHONPATH=src python bench/probes/backward_fused_bias.py

Writes ``$OUT/backward-fused-bias.json``.
"""

from __future__ import annotations

import os
import tempfile
from functools import partial
from pathlib import Path

import torch
from _rounds import interleaved_rows
from forward_ab import absolute_imports, load
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from flashtile.bench.common import save_result
from flashtile.bench.shapes import shape
from flashtile.kernels import backward as package_backward
from flashtile.kernels.forward import flash_attention

EDITS = [
    ("pT = p_from_raw_dots(uT, m[None, :], log2_l[None, :], qk_scale)  # never stored",
     "pT = tl.math.exp2(uT * qk_scale - (m * qk_scale + log2_l)[None, :])  # ablation: one bias per row"),
    ("p = p_from_raw_dots(u, m[:, None], log2_l[:, None], qk_scale)",
     "p = tl.math.exp2(u * qk_scale - (m * qk_scale + log2_l)[:, None])  # ablation: one bias per row"),
]
HEADS = {64: 32, 128: 16, 256: 8}
SHAPES = [shape(16384 // T, HEADS[D], T, D, causal) for D in (64, 128) for T in (2048, 8192)
          for causal in (False, True)]  # fmt: skip
SHAPES += [shape(2, 8, 8192, 256, causal) for causal in (False, True)]


def fused_module(folder: Path):
    source = Path(package_backward.__file__).read_text()
    for old, new in EDITS:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    (folder / "backward_fused.py").write_text(absolute_imports(source))
    return load("backward_fused", str(folder / "backward_fused.py"))


def measure(s: dict, versions: dict, rounds: int = 3) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(s["B"], s["H"], s["Tq"], s["D"], device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(4))  # fmt: skip
    causal = s["causal"]
    o, lse, stats = flash_attention(q, k, v, causal=causal, return_stats=True)
    calls = {name: partial(m.flash_attention_backward, q, k, v, o, lse, do, causal, stats=stats)
             for name, m in versions.items()}  # fmt: skip
    truth = calls["package"]()
    errors = {name: max((a.float() - b.float()).abs().max().item() for a, b in zip(call(), truth))
              for name, call in calls.items()}  # fmt: skip
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o_s = scaled_dot_product_attention(*leaves, is_causal=causal)
    calls["sdpa_cudnn"] = partial(o_s.backward, do, retain_graph=True)
    rows = interleaved_rows(s, calls, "bwd", rounds)
    for row in rows:
        name = row["provider"].removeprefix("flashtile_")
        if name in errors:
            row["max_diff_vs_package"] = errors[name]
    print(s["D"], s["Tq"], causal, "  ".join(f"{r['provider']} {r['tflops']} ({r['ratio_to_cudnn']})" for r in rows),
          errors, flush=True)  # fmt: skip
    return rows


def main(out: Path) -> None:
    with tempfile.TemporaryDirectory() as folder:
        versions = {"package": package_backward, "fused": fused_module(Path(folder))}
        rows = [row for s in SHAPES for row in measure(s, versions)]
    save_result(out / "backward-fused-bias.json", rows, "do_bench median (warmup 25 ms, rep 100 ms) per round, 3 "
                "interleaved rounds with cuDNN (o.backward through autograd), the median of the rounds; flashtile: "
                "each version's flash_attention_backward called directly with the forward's stats",
                versions={"fused": EDITS})


if __name__ == "__main__":
    main(Path(os.environ.get("OUT", ".")))
