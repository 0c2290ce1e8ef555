"""A measured probe, not part of the package: what the forward's softmax costs, by taking its parts out.

Issue 35's forward target at head dim 256 is 0.90x cuDNN; the package runs 0.74-0.85x there (``forward-d256.json``)
and its launch settings' neighbours were all slower (``sweeps/backward-d256-configs-round2.json``). This
ablation asks what is left when parts of the key loop's work are removed from a copy of the package's kernel
(``kernels/forward.py``, loaded as its own module as ``forward_ab.py`` does):

* ``no_exp``: the online softmax as it is (row max, shift, rescale of acc and l, row sum) but P = the
  shifted score itself, not exp2 of it: the exponentials of the tile are gone, nothing else;
* ``matmuls_only``: acc += cast(S) V and nothing else in the loop: the two matmuls and the loads of the
  package's tiles, settings and launch order, the ceiling of this kernel's form.

The ablations' outputs are not attention (they are timed, never checked); the package's is checked against
cuDNN first. Cells: head dim 256 at the issue's shapes (H = 8, B * T = 16384, T 2k-8k, causal and not) and
head dim 128 at T = 2k, the standard sweep's cells below 0.92x. Interleaved rounds with cuDNN, as in
``forward_ab.py``.

    OUT=/some/folder PYTHONPATH=src python bench/probes/forward_ablation.py

Writes ``$OUT/forward-ablation.json``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rounds import interleaved_rows  # noqa: E402
from forward_ab import absolute_imports, load  # noqa: E402

from flashtile.bench.common import save_result  # noqa: E402
from flashtile.bench.shapes import shape  # noqa: E402
from flashtile.kernels import forward as package_forward  # noqa: E402

STEP = ("            acc, l, m, shift, largest = fused_softmax_step(acc, l, m, shift, largest, u, v, qk_scale, "
        "DOT_PRECISION,\n" + " " * 59 + "INTERPRETED)")
NO_EXP = """            acc, l, m, shift, largest = _step_without_exp(acc, l, m, shift, largest, u, v, qk_scale)"""
MATMULS_ONLY = """            acc = tl.dot(u.to(v.dtype), v, acc, input_precision=DOT_PRECISION)"""
STEP_WITHOUT_EXP = '''

@triton.jit
def _step_without_exp(acc, l, m, shift, largest, u, v, qk_scale):
    """fused_softmax_step with P = the shifted score instead of exp2 of it (an ablation: not attention)."""
    m_new = tl.maximum(m, tl.max(u, 1))
    shift_new = m_new * qk_scale
    shift_safe = tl.where(m_new == float("-inf"), 0.0, shift_new)
    alpha = tl.math.exp2(shift - shift_safe)  # one per row, kept
    p = u * qk_scale - shift_safe[:, None]
    l = alpha * l + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    largest = tl.where(tl.abs(shift_safe) > largest, tl.abs(shift_safe), largest)
    return acc, l, m_new, shift_new, largest
'''
CELLS = [shape(16384 // T, 8, T, 256, causal) for T in (2048, 4096, 8192) for causal in (False, True)]
CELLS += [shape(8, 16, 2048, 128, causal) for causal in (False, True)]


def versions(folder: Path) -> dict:
    source = Path(package_forward.__file__).read_text()
    assert source.count(STEP) == 1, "the loop's softmax step moved: update STEP"
    marker = "\n@triton.jit\ndef _attend_key_tiles("
    assert source.count(marker) == 1
    texts = {
        "no_exp": source.replace(STEP, NO_EXP).replace(marker, STEP_WITHOUT_EXP + marker),
        "matmuls_only": source.replace(STEP, MATMULS_ONLY),
    }
    out = {"package": package_forward}
    for name, text in texts.items():
        (folder / f"{name}.py").write_text(absolute_imports(text))
        out[name] = load(name, str(folder / f"{name}.py"))
    return out


def measure(s: dict, modules: dict, rounds: int = 3) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(s["B"], s["H"], s["Tq"], s["D"], device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))  # fmt: skip
    causal = s["causal"]
    cudnn = lambda: scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        truth = cudnn().float()
    calls = {name: (lambda m=m: m.flash_attention(q, k, v, causal=causal)) for name, m in modules.items()}
    error = (calls["package"]()[0].float() - truth).abs().max().item()
    assert error < 0.05, error
    calls = {"sdpa_cudnn": cudnn, **calls}
    rows = [dict(row, pass_="forward") for row in interleaved_rows(s, calls, "fwd", rounds, contexts={
        "sdpa_cudnn": lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION])})]
    print(f"D{s['D']} T{s['Tq']} {'causal' if causal else 'nomask'}: "
          + "  ".join(f"{r['provider']} {r['tflops']} ({r['ratio_to_cudnn']})" for r in rows), flush=True)  # fmt: skip
    return [{("pass" if key == "pass_" else key): val for key, val in row.items()} for row in rows]


def main(out: Path) -> None:
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    with tempfile.TemporaryDirectory() as folder:
        modules = versions(Path(folder))
        rows = [row for s in CELLS for row in measure(s, modules)]
    save_result(out / "forward-ablation.json", rows, "do_bench median (warmup 25 ms, rep 100 ms) per round, 3 "
                "interleaved rounds with cuDNN, the median of the rounds; the package's output checked against "
                "cuDNN's first; the ablations' outputs are not attention and are not checked",
                ablations={"no_exp": "P = the shifted score, not exp2 of it", "matmuls_only": "acc += cast(S) V only"})


if __name__ == "__main__":
    main(Path(os.environ.get("OUT", ".")))
