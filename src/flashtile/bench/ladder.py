"""The ladders: every rung of the forward and backward worklogs, the package and cuDNN, timed in one run.

``python -m flashtile.bench ladder`` writes ``bench/results/ladder-forward.json`` and
``bench/results/ladder-backward.json``. For each shape (H = 16, B·T = 16,384, bf16, ``bhtd``: the lab's
B 8, T 2048, D 64 causal, then D 128, causal and not, T 512 and 8k) it times rung 0 (the textbook kernel),
every rung of ``kernels.ladder`` in order, the package's kernel (provider ``flashtile``, ``rung`` = the last
rung + 1) and SDPA's cuDNN backend, in one process on one set of inputs:

- forward: each provider's o is first checked against the float32 truth (``providers.check_output``);
- backward: every provider gets the same o, lse and dO (the package's forward), and its dq, dk, dv are
  first checked against SDPA flash's (cuDNN's where flash refuses); the rungs and the package are timed as
  their launchers alone (``backward(q, k, v, o, lse, do, causal)``), cuDNN as ``torch.autograd.grad(o, (q, k, v), do)``.

Each call is captured once in a CUDA graph and the graph's replay is timed (``common.graph_ms``): the GPU's
time without the host's, so that a rung's Python launch path (the textbook's checks on every call) cannot
hide a kernel's gain at short lengths; a provider whose call cannot be captured is timed plainly, and its
rows say ``"timing": "plain"`` instead of ``"cuda_graph"``. Times are interleaved: ``--rounds`` rounds, each
timing every provider once (``triton.testing.do_bench`` median, warm-up 25 ms, rep 100 ms) in an order that
starts one provider later each round; a row's ``ms`` is the median of its rounds, and ``ms_rounds`` keeps
them all. A rung's gain is its time against the rung before it in the same file, so the gains multiply to
the total.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from ..kernels.ladder import entry_point, rungs
from . import providers as prov
from .common import RESULTS, attention_tflops, graph_ms, median_ms, save_result
from .forward import error_reason
from .shapes import describe, shape

SHAPES = [shape(16384 // T, 16, T, D, causal) for T, D, causal in (
    (2048, 64, True), (2048, 64, False), (2048, 128, True), (2048, 128, False), (512, 64, True), (8192, 64, True))]
METHOD = {
    "forward": "forward only; one call captured in a CUDA graph, its replay timed (row timing: cuda_graph; plain "
               "where capture failed); interleaved rounds: each round times every provider once with "
               "triton.testing.do_bench (median, warmup 25 ms, rep 100 ms), the order rotated by one each round; "
               "ms = median of the rounds; "
               "each provider's o first checked against a float32 softmax(QK^T/sqrt(D))V; "
               "TFLOP/s = 4*B*H*Tq*Tk*D (x0.5 causal) / time",
    "backward": "backward only, on the package forward's o and lse: rungs and package as their launchers "
                "backward(q, k, v, o, lse, do, causal), sdpa_cudnn as torch.autograd.grad(o, (q, k, v), do); CUDA "
                "graph replays and interleaved rounds as the forward's; gradients first checked against SDPA flash's; "
                "TFLOP/s = 2.5*4*B*H*Tq*Tk*D (x0.5 causal) / time",
}
TIMING = dict(warmup=25, rep=100)
GRAD_TOLERANCE = 0.25  # bf16 gradients against SDPA's, max abs (as the backward table's check)


def provider_name(rung) -> str:
    return "flashtile_textbook" if rung.index == 0 else f"flashtile_rung_{rung.name}"


def graph_or_plain(fn, **timing) -> tuple[float, str]:
    """(ms, how): one replay of ``fn`` captured in a CUDA graph, or ``fn()`` itself where capture fails."""
    try:
        return graph_ms(fn, **timing), "cuda_graph"
    except Exception:  # a call that cannot be captured (a host sync, an allocation the graph refuses)
        torch.cuda.synchronize()
        return median_ms(fn, **timing), "plain"


def interleaved_ms(fns: dict, rounds: int, **timing) -> tuple[dict[str, list[float]], dict[str, str]]:
    """(name -> the times of ``fn()`` over ``rounds`` rounds, name -> how it was timed); round r starts at
    the r-th provider."""
    names = list(fns)
    times, how = {name: [] for name in names}, {}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            ms, how[name] = graph_or_plain(fns[name], **timing)
            times[name].append(ms)
    return times, how


def forward_providers(s: dict) -> dict:
    """provider -> (q, k, v) -> o, with its rung index (None for cuDNN), in ladder order."""
    from ..kernels.forward import flash_attention

    causal, found = s["causal"], {}
    for rung in rungs("forward"):
        fn = entry_point(rung, "forward")
        found[provider_name(rung)] = (rung.index, lambda q, k, v, fn=fn: fn(q, k, v, causal)[0])
    found["flashtile"] = (len(found), lambda q, k, v: flash_attention(q, k, v, causal=causal)[0])
    found["sdpa_cudnn"] = (None, prov.build("sdpa_cudnn", s))
    return found


def backward_providers(s: dict) -> dict:
    """provider -> (q, k, v, o, lse, do, stats) -> (dq, dk, dv), with its rung index, in ladder order."""
    from ..kernels.backward import flash_attention_backward

    causal, found = s["causal"], {}
    for rung in rungs("backward"):
        fn = entry_point(rung, "backward")
        found[provider_name(rung)] = (rung.index, lambda q, k, v, o, lse, do, stats, fn=fn: fn(q, k, v, o, lse, do,
                                                                                                causal))
    found["flashtile"] = (len(found), lambda q, k, v, o, lse, do, stats: flash_attention_backward(
        q, k, v, o, lse, do, causal=causal, stats=stats))
    return found


def row(s: dict, direction: str, provider: str, rung: int | None, times: list[float] | None, error=None, **extra):
    base = {"pass": direction, "provider": provider, **({"rung": rung} if rung is not None else {}), **s}
    if times is None:
        return dict(base, ms=None, tflops=None, error=error)
    ms = statistics.median(times)
    mode = "fwd" if direction == "forward" else "bwd"
    return dict(base, ms=round(ms, 4), tflops=round(attention_tflops(s, ms, mode), 1),
                ms_rounds=[round(t, 4) for t in times], **extra)  # fmt: skip


def measure_forward(s: dict, rounds: int) -> list[dict]:
    q, k, v = prov.make_inputs(s)
    truth = prov.reference_output(q, k, v, s["causal"])
    found, rows, fns, errors = forward_providers(s), [], {}, {}
    for name, (rung, fn) in found.items():
        try:
            o = fn(q, k, v)  # compiles
        except RuntimeError as exc:
            if name.startswith("flashtile"):
                raise
            rows.append(row(s, "forward", name, rung, None, error_reason(exc)))
            continue
        errors[name] = prov.check_output(name, o, truth, s["dtype"])  # raises WrongAnswer: never timed
        fns[name] = lambda fn=fn: fn(q, k, v)
    times, how = interleaved_ms(fns, rounds, **TIMING)
    for name, (rung, _) in found.items():
        if name in fns:
            rows.append(row(s, "forward", name, rung, times[name], timing=how[name],
                            max_abs_err_vs_fp32=float(f"{errors[name]:.3g}")))  # fmt: skip
    return sorted(rows, key=lambda r: list(found).index(r["provider"]))


def measure_backward(s: dict, rounds: int) -> list[dict]:
    from ..kernels.forward import flash_attention

    q, k, v = prov.make_inputs(s)
    do = torch.randn_like(q)
    o, lse, stats = flash_attention(q, k, v, causal=s["causal"], return_stats=True)
    expected = None
    for backend in ("sdpa_flash", "sdpa_cudnn"):
        try:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            prov.build(backend, s)(*leaves).backward(do)
            expected = [t.grad for t in leaves]
            break
        except RuntimeError:
            continue
    found, rows, fns, errors = backward_providers(s), [], {}, {}
    for name, (_, fn) in found.items():
        grads = fn(q, k, v, o, lse, do, stats)  # compiles
        if expected is not None:
            errors[name] = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, expected))
            if errors[name] > GRAD_TOLERANCE:
                raise AssertionError(f"{name} gradients disagree with SDPA's by {errors[name]} at {describe(s)}")
        fns[name] = lambda fn=fn: fn(q, k, v, o, lse, do, stats)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    try:
        o_cudnn = prov.build("sdpa_cudnn", s)(*leaves)
        fns["sdpa_cudnn"] = lambda: torch.autograd.grad(o_cudnn, leaves, do, retain_graph=True)
        found["sdpa_cudnn"] = (None, None)
    except RuntimeError as exc:
        rows.append(row(s, "backward", "sdpa_cudnn", None, None, error_reason(exc)))
    times, how = interleaved_ms(fns, rounds, **TIMING)
    for name, (rung, _) in found.items():
        if name in fns:
            extra = {"max_abs_grad_diff_vs_sdpa": float(f"{errors[name]:.3g}")} if name in errors else {}
            rows.append(row(s, "backward", name, rung, times[name], timing=how[name], **extra))
    return sorted(rows, key=lambda r: list(found).index(r["provider"]))


def run(direction: str, shapes: list[dict], rounds: int, out) -> dict:
    measure = measure_forward if direction == "forward" else measure_backward
    rows = []
    for s in shapes:
        print(f"{direction} {describe(s)}", file=sys.stderr, flush=True)
        new = measure(s, rounds)
        for r in new:
            print(f"  {r['provider']:>32} {r['ms']} ms {r['tflops']} TFLOP/s", file=sys.stderr, flush=True)
        rows += new
        torch.cuda.empty_cache()
    names = [r.name for r in rungs(direction)]
    return save_result(out, rows, METHOD[direction], rungs=names, rounds=rounds)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flashtile.bench ladder", description=__doc__.splitlines()[0])
    parser.add_argument("--passes", default="forward,backward", help="forward, backward or both (default)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per shape (default 5)")
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="only the first N shapes (the lab's first)")
    parser.add_argument("--out", default=str(RESULTS), help="folder for ladder-forward.json and ladder-backward.json")
    args = parser.parse_args(argv)
    passes = [p for p in args.passes.split(",") if p]
    if not passes or any(p not in ("forward", "backward") for p in passes):
        raise SystemExit(f"--passes: expected forward, backward or both, got {args.passes!r}")
    if args.rounds < 1 or not 1 <= args.shapes <= len(SHAPES):
        raise SystemExit(f"--rounds must be >= 1 and --shapes 1..{len(SHAPES)}")
    if not torch.cuda.is_available():
        raise SystemExit("the ladder is timed on a CUDA device; none is available")
    for direction in passes:
        result = run(direction, SHAPES[: args.shapes], args.rounds, f"{args.out}/ladder-{direction}.json")
        print(f"wrote {args.out}/ladder-{direction}.json ({len(result['rows'])} rows)", file=sys.stderr)
