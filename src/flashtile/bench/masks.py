"""Mask table: sliding windows beside compiled FlexAttention and full-causal cuDNN, forward and backward, same run.

``python -m flashtile.bench masks`` measures issue 36's window shapes (B = 1, H = 16, D = 128, bf16, ``bhtd``:
a window of W = 1024 keys at T = 16k and of W = 4096 at T = 32k) and writes ``bench/results/masks.json``
(``--out`` elsewhere; ``--shapes 16k`` or ``32k`` for one of them). A window of W keys is Mistral's: query
i sees keys i - W + 1 .. i, which ``flashtile.attention`` spells ``is_causal=True, window=(W - 1, 0)``
and the rows' ``mask`` field ``window:W-1,0``.

Providers (``--providers``; the first three by default):

- ``flashtile``: ``flashtile.attention`` with the window (key tiles outside the band never loaded);
- ``flex``: ``torch.nn.attention.flex_attention`` compiled by ``torch.compile``, with a block mask made
  from the same predicate (kv <= q and q - kv < W), so it skips the same tiles;
- ``sdpa_cudnn``: SDPA's cuDNN backend on the full causal mask (``mask: causal``), what a model runs where
  its attention has no window;
- ``flashtile_causal``: ``flashtile.attention`` on the full causal mask, the same baseline for our kernels.

``--shapes documents`` measures the issue's packed case: 8 documents of 512-4096 tokens (``document_lengths``,
a fixed seed, 16,384 tokens in all), causal within each, B = 1, H = 16, D = 128, bf16: ``flashtile`` is
``flashtile.attention_varlen`` on contiguous packed (16384, 16, 128) copies of the same values, the layout a
packed model's projections produce and the function's own (its checks of cu_seqlens are timed too),
``flex`` the same document-causal block mask on the (1, 16, 16384, 128) tensors, its own layout,
and ``sdpa_cudnn`` full causal on the 16k row, the context. Those rows carry ``mask: "documents:8"`` and
every row of a case its ``case`` (the window rows' is their window), so that a table tells the 16k window
rows from the 16k document rows.

FLOPs count only the pairs each row's mask keeps (``reference.masks.window_attention_flops``; causal is
the window (-1, 0)), 4 per pair and head dim, x2.5 for a backward, for every provider. Before timing,
every forward output is checked against a float32 truth built block by block from the mask's definition,
and every provider's gradients against those of another implementation of the same mask (flashtile's
against flex's, and the two causal providers against each other), so no wrong answer is ever timed.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from ..reference.masks import document_visible_pairs, window_attention_flops
from .common import RESULTS, median_ms, save_result
from .forward import error_reason, free_memory
from .providers import _sdpa, check_output, make_inputs, reference_output
from .shapes import describe, shape

WINDOW_SHAPES = {"16k": (16384, 1024), "32k": (32768, 4096)}  # name -> (T, W): issue 36's two cases
CASES = (*WINDOW_SHAPES, "documents")  # what --shapes takes: the two windows and the packed documents
DEFAULT_PROVIDERS = ("flashtile", "flex", "sdpa_cudnn")
PROVIDERS = (*DEFAULT_PROVIDERS, "flashtile_causal")
WINDOWED = ("flashtile", "flex")  # the providers that run the window; the others run full causal
METHOD = (
    "triton.testing.do_bench median (warmup 50 ms, rep 200 ms); forward under no_grad, backward alone "
    "(o.backward(do, retain_graph=True)); TFLOP/s = 4*B*H*D*(pairs the row's mask keeps) (x2.5 backward) / time; "
    "each forward checked against a float32 truth from the mask's definition, gradients across providers"
)
GRAD_TOLERANCE = 0.25  # the largest |difference| of two bf16 implementations' gradients, as bench.backward allows


def window_truth(q, k, v, W: int, rows: int = 1024) -> torch.Tensor:
    """softmax(Q Kᵀ / sqrt(D)) V in float32 under the causal window of W keys (key j for query i when
    i - W < j <= i), (B, H, T, D); a block of query rows at a time, each against only the keys it can see."""
    B, H, T, D = q.shape
    group = H // k.shape[1]
    out = torch.empty(B, H, T, D, dtype=torch.float32, device=q.device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the truth must be float32 arithmetic
    try:
        for start in range(0, T, rows):
            stop, first = min(T, start + rows), max(0, start - W + 1)
            kb = k[:, :, first:stop].float().repeat_interleave(group, dim=1)
            vb = v[:, :, first:stop].float().repeat_interleave(group, dim=1)
            s = q[:, :, start:stop].float() @ kb.transpose(-1, -2) / math.sqrt(D)
            i = torch.arange(start, stop, device=q.device)[:, None]
            j = torch.arange(first, stop, device=q.device)[None, :]
            s = s.masked_fill(~((j <= i) & (j > i - W)), float("-inf"))
            out[:, :, start:stop] = torch.softmax(s, dim=-1) @ vb
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return out


def flex_window(T: int, W: int, device):
    """Compiled flex_attention with the block mask of the causal window of W keys."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()  # one fresh compile per shape
    compiled = torch.compile(flex_attention, dynamic=False)
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (q_idx - kv_idx < W), None, None, T, T,
                             device=device)  # fmt: skip
    return lambda q, k, v: compiled(q, k, v, block_mask=mask)


def build(name: str, T: int, W: int, device):
    """(q, k, v) -> o, differentiable, for provider ``name``; the window's providers take the window."""
    from ..api import attention

    if name == "flashtile":
        return lambda q, k, v: attention(q, k, v, is_causal=True, window=(W - 1, 0))
    if name == "flex":
        return flex_window(T, W, device)
    if name == "sdpa_cudnn":
        return _sdpa("CUDNN_ATTENTION", True, False)
    if name == "flashtile_causal":
        return lambda q, k, v: attention(q, k, v, is_causal=True)
    raise ValueError(f"unknown provider {name!r}; known: {', '.join(PROVIDERS)}")


def row(s: dict, name: str, W: int, which: str, ms=None, error=None, **extra) -> dict:
    """A schema row; ``mask`` and the FLOPs from the pairs that provider's mask keeps."""
    window = (W - 1, 0) if name in WINDOWED else None
    mask = f"window:{W - 1},0" if window else "causal"
    base = dict({"pass": which}, **s, provider=name, mask=mask, case=f"window:{W - 1},0")
    if ms is None:
        return dict(base, ms=None, tflops=None, error=error)
    flops = window_attention_flops(s["B"], s["H"], s["Tq"], s["Tk"], s["D"], window, True)
    flops *= 2.5 if which == "backward" else 1.0
    return dict(base, ms=round(ms, 4), tflops=round(flops / (ms * 1e-3) / 1e12, 1), **extra)


def measure_case(names, provider, row_of, s: dict, inputs, truth, label: str) -> list[dict]:
    """Forward and backward rows for every provider in ``names`` on one case, and their gradients compared.

    ``provider(name)`` gives provider ``name``'s differentiable (q, k, v) -> o; ``row_of(name, pass, ms=None,
    error=None, **extra)`` its schema row; ``s`` is the case's shape, ``inputs`` its (q, k, v, do) and ``truth``
    the float32 output under the case's own mask, which the ``WINDOWED`` providers are checked against (the
    others run full causal and are checked against ``reference_output``); ``label`` names the case on the
    progress line and in a gradient mismatch. A provider with a ``layout`` attribute, (to_own, from_own), runs
    on the inputs moved into its own layout by ``to_own`` (outside the timing), and ``from_own`` brings its
    output and gradients back for the checks."""
    q, k, v, do = inputs
    truths = {"mask": truth}
    if any(n not in WINDOWED for n in names):
        truths["causal"] = reference_output(q, k, v, True)
    rows, grads = [], {}
    for name in names:
        try:
            fn = provider(name)
            to_own, from_own = getattr(fn, "layout", (lambda x: x, lambda x: x))
            own = [to_own(x) for x in (q, k, v, do)]  # the same values in the provider's own layout
            with torch.no_grad():
                o = from_own(fn(*own[:3]))
            err = check_output(name, o, truths["mask" if name in WINDOWED else "causal"], s["dtype"])
            with torch.no_grad():
                ms = median_ms(lambda fn=fn, own=own: fn(*own[:3]))
            rows.append(row_of(name, "forward", ms, max_abs_error_vs_fp32=round(err, 5)))
            leaves = [t.detach().requires_grad_() for t in own[:3]]
            o = fn(*leaves)
            o.backward(own[3], retain_graph=True)
            grads[name] = [from_own(t.grad.clone()) for t in leaves]
            ms = median_ms(lambda o=o, do=own[3]: o.backward(do, retain_graph=True), grad_to_none=leaves)
            rows.append(row_of(name, "backward", ms))
            del leaves, o, fn, own
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            if name.startswith("flashtile") and not isinstance(exc, torch.OutOfMemoryError):
                raise
            rows.append(row_of(name, "forward", error=error_reason(exc)))
            rows.append(row_of(name, "backward", error=error_reason(exc)))
            free_memory(q.device)
        for r in rows[-2:]:
            speed = "" if r["ms"] is None else f"{r['ms']:.3f} ms {r['tflops']:.1f} TFLOP/s"
            print(f"{name:>17} {r['pass']:>8} {label} {speed or r['error'][:60]}", file=sys.stderr, flush=True)
    for a, b in (("flashtile", "flex"), ("flashtile_causal", "sdpa_cudnn")):  # one mask, two implementations
        if a in grads and b in grads:
            diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(grads[a], grads[b]))
            assert diff < GRAD_TOLERANCE, f"{a} and {b} gradients differ by {diff} on {label}"
            for r in rows:
                if r["pass"] == "backward" and r["provider"] in (a, b) and r["ms"] is not None:
                    r[f"max_abs_grad_diff_vs_{b if r['provider'] == a else a}"] = round(diff, 5)
    return rows


def measure(T: int, W: int, names) -> list[dict]:
    """Forward and backward rows for every provider at (T, W)."""
    s = shape(1, 16, T, 128, True)
    q, k, v = make_inputs(s)
    do = torch.randn_like(q)

    def window_row(name, which, ms=None, error=None, **extra):
        return row(s, name, W, which, ms, error, **extra)

    provider = lambda name: build(name, T, W, q.device)
    truth = window_truth(q, k, v, W)
    return measure_case(names, provider, window_row, s, (q, k, v, do), truth, f"W={W} {describe(s)}")


# --- packed documents -----------------------------------------------------------------------------------------


def document_lengths(n: int = 8, total: int = 16384, low: int = 512, high: int = 4096, seed: int = 0) -> list[int]:
    """n document lengths in [low, high] summing to ``total``: drawn uniformly with a fixed seed, then the
    difference from the total spread one token at a time over the documents that stay in range."""
    if not n * low <= total <= n * high:
        raise ValueError(f"{n} documents of {low}..{high} tokens cannot sum to {total}")
    lengths = torch.randint(low, high + 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    while sum(lengths) != total:
        step = 1 if sum(lengths) < total else -1
        for d in range(n):
            if sum(lengths) != total and low <= lengths[d] + step <= high:
                lengths[d] += step
    return lengths


def cu_seqlens(lengths, device=None) -> torch.Tensor:
    """int32 [0, n_1, n_1 + n_2, ...]."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def documents_truth(q, k, v, lengths) -> torch.Tensor:
    """Causal attention within each document in float32, (B, H, T, D): each document's rows against its own keys
    only, through ``providers.reference_output``."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        out[:, :, part] = reference_output(q[:, :, part], k[:, :, part], v[:, :, part], True)
        start += n
    return out


def flex_documents(lengths, device):
    """Compiled flex_attention with the block mask of causal attention within each document."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    T = sum(lengths)
    document = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: (document[q_idx] == document[kv_idx]) & (kv_idx <= q_idx),
                             None, None, T, T, device=device)  # fmt: skip
    return lambda q, k, v: compiled(q, k, v, block_mask=mask)


def build_documents(name: str, lengths, device):
    """(q, k, v) -> o on (1, H, T, D) tensors, differentiable, for provider ``name`` on the packed documents."""
    from ..varlen import attention_varlen

    if name == "flashtile":
        cu = cu_seqlens(lengths, device)
        longest = max(lengths)

        def packed(q, k, v):  # on contiguous (T, H, D) tensors, as a packed model holds them
            return attention_varlen(q, k, v, cu, cu, longest, longest, is_causal=True)

        packed.layout = (lambda x: x[0].transpose(0, 1).contiguous(), lambda x: x.transpose(0, 1)[None])
        return packed
    if name == "flex":
        return flex_documents(lengths, device)
    if name == "sdpa_cudnn":
        return _sdpa("CUDNN_ATTENTION", True, False)
    if name == "flashtile_causal":
        from ..api import attention

        return lambda q, k, v: attention(q, k, v, is_causal=True)
    raise ValueError(f"unknown provider {name!r}; known: {', '.join(PROVIDERS)}")


def documents_row(s: dict, name: str, lengths, which: str, ms=None, error=None, **extra) -> dict:
    """A schema row of the packed case: ``mask`` "documents:N" for the providers that run the documents,
    "causal" (over the whole row) for the others; FLOPs from the pairs that mask keeps."""
    documents = name in WINDOWED
    mask = f"documents:{len(lengths)}" if documents else "causal"
    base = dict({"pass": which}, **s, provider=name, mask=mask, case=f"documents:{len(lengths)}",
                lengths=list(lengths))  # fmt: skip
    if ms is None:
        return dict(base, ms=None, tflops=None, error=error)
    if documents:
        cu = cu_seqlens(lengths).tolist()
        pairs = document_visible_pairs(cu, cu, causal=True)
    else:
        pairs = s["Tq"] * (s["Tq"] + 1) // 2
    flops = 4 * s["B"] * s["H"] * s["D"] * pairs * (2.5 if which == "backward" else 1.0)
    return dict(base, ms=round(ms, 4), tflops=round(flops / (ms * 1e-3) / 1e12, 1), **extra)


def measure_documents(names, lengths=None) -> list[dict]:
    """Forward and backward rows for every provider on the packed documents (``document_lengths()`` by default)."""
    lengths = document_lengths() if lengths is None else list(lengths)
    s = shape(1, 16, sum(lengths), 128, True)
    q, k, v = make_inputs(s)
    do = torch.randn_like(q)

    def document_row(name, which, ms=None, error=None, **extra):
        return documents_row(s, name, lengths, which, ms, error, **extra)

    provider = lambda name: build_documents(name, lengths, q.device)
    truth = documents_truth(q, k, v, lengths)
    return measure_case(names, provider, document_row, s, (q, k, v, do), truth, f"documents {lengths}")


def parse_names(text: str, known, what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in known for n in names):
        raise argparse.ArgumentTypeError(f"{what} must be a comma list of {', '.join(known)}; got {text!r}")
    return names


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flashtile.bench masks", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(CASES), type=lambda t: parse_names(t, CASES, "--shapes"),
                        help=f"comma list of {', '.join(CASES)} (default: all)")  # fmt: skip
    parser.add_argument("--providers", default=",".join(DEFAULT_PROVIDERS),
                        type=lambda t: parse_names(t, PROVIDERS, "--providers"),
                        help=f"comma list (default: {','.join(DEFAULT_PROVIDERS)}; also flashtile_causal)")
    parser.add_argument("--out", default=str(RESULTS / "masks.json"), help="the output file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the benchmarks need a CUDA device")
    rows = []
    for name in args.shapes:
        if name == "documents":
            rows += measure_documents(args.providers)
        else:
            rows += measure(*WINDOW_SHAPES[name], args.providers)
    save_result(args.out, rows, METHOD, providers=list(args.providers))
