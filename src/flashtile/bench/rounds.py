"""Interleaved rounds: every provider of one case timed forward and backward in turn, several rounds.

A provider is a ``Contender``: a differentiable function, the tensors it takes (its own layout, its own
extra arguments such as sinks) and the extra fields of its rows. ``run_rounds`` checks each forward
output against the case's float32 truth before anything is timed (a wrong answer is never timed), keeps
its first gradients for a comparison across providers, and times the forward (under ``no_grad``) and the
backward alone (``o.backward(do, retain_graph=True)``) once per round, the providers taking turns and the
turn order rotated by one each round, so that a clock or thermal drift during the run, or a provider's
effect on the next one, falls on all of them alike; a row's time is the median of its rounds. A provider
other than flashtile's that fails in any round (out of memory, an SDPA backend refusing the shape, a
compile error) gets rows that say why and no time; one of flashtile's that fails is a bug, and raises.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from .common import median_ms, save_result
from .forward import error_reason, free_memory
from .providers import check_output


class Contender(NamedTuple):
    fn: Callable  # (*inputs) -> o, differentiable
    inputs: tuple  # the tensors it takes, gradients wanted for each
    names: tuple  # what each input is ("q", "k", "v", "sinks"): gradients are compared by name
    fields: dict  # the row's extra schema fields (provider, sinks, D_v, mask...)
    truth: torch.Tensor  # the float32 output its forward is checked against (in its output's layout)


class Outcome(NamedTuple):
    forward_ms: list
    backward_ms: list
    max_abs_err_vs_fp32: float | None
    grads: dict  # input name -> its gradient (float32), from the first round
    error: str | None


def run_rounds(contenders: dict, do: torch.Tensor, dtype: str, *, rounds: int, label: str) -> dict:
    """{name: Outcome} for every contender; see the module docstring. ``do`` is the output gradient, the
    same for every contender (their outputs have one shape); ``dtype`` the bench name of the inputs' dtype,
    which sets the tolerance of the check against each contender's truth."""
    state = {name: Outcome([], [], None, {}, None) for name in contenders}
    names = list(contenders)
    for r in range(rounds):
        turn = r % len(names)
        for name in names[turn:] + names[:turn]:
            c = contenders[name]
            if state[name].error is not None:
                continue
            try:
                state[name] = one_round(name, c, do, dtype, state[name], first=r == 0)
            except Exception as exc:
                if name.startswith("flashtile") and not isinstance(exc, torch.OutOfMemoryError):
                    raise
                state[name] = state[name]._replace(error=error_reason(exc))
                free_memory(do.device)
            s = state[name]
            if s.error is not None:
                print(f"{name:>20} {label}: {s.error[:80]}", file=sys.stderr, flush=True)
            else:
                print(f"{name:>20} {label} round {r}: fwd {s.forward_ms[-1]:.3f} ms, bwd {s.backward_ms[-1]:.3f} ms",
                      file=sys.stderr, flush=True)  # fmt: skip
    return state


def one_round(name: str, c: Contender, do, dtype: str, s: Outcome, first: bool) -> Outcome:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SDPA explains a refusal in warnings; the error says enough
        err = s.max_abs_err_vs_fp32
        if first:
            with torch.no_grad():
                err = check_output(name, c.fn(*c.inputs), c.truth, dtype)
        with torch.no_grad():
            fwd = median_ms(lambda: c.fn(*c.inputs))
        leaves = [x.detach().requires_grad_() for x in c.inputs]
        o = c.fn(*leaves)
        grads = s.grads
        if first:
            o.backward(do, retain_graph=True)
            grads = {n: x.grad.float() for n, x in zip(c.names, leaves)}
        bwd = median_ms(lambda: o.backward(do, retain_graph=True), grad_to_none=leaves)
    return Outcome(s.forward_ms + [fwd], s.backward_ms + [bwd], err, grads, None)


def relative_grad_difference(a: dict, b: dict) -> float:
    """The largest, over the inputs both have, of ||a - b|| / ||b||: one number for two providers' gradients."""
    worst = 0.0
    for n in a.keys() & b.keys():
        worst = max(worst, ((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-30)).item())
    return worst


def median_or_none(times: list) -> float | None:
    return statistics.median(times) if times else None


GRAD_RTOL = 0.05  # ||g - g_ours|| / ||g_ours|| allowed between two bf16 implementations


def outcome_rows(outcomes: dict, contenders: dict, base: dict, flops: float, *, compared: dict) -> list[dict]:
    """The schema rows of one case: forward and backward for every contender (``base``, the case's shape and
    fields, then the contender's own), TFLOP/s from ``flops`` (x2.5 backward), the rounds' times, the forward's
    error, and for each contender ``compared`` maps to a reference contender (one of flashtile's computing the
    same function), its gradients against the reference's (asserted within ``GRAD_RTOL``). A contender that
    failed in any round gets no time, only the reason."""
    rows = []
    for key, c in contenders.items():
        out = outcomes[key]
        for which, times, factor in (("forward", out.forward_ms, 1.0), ("backward", out.backward_ms, 2.5)):
            row = {"pass": which, **base, **c.fields}
            ms = median_or_none(times)
            if ms is None or out.error is not None:
                rows.append(dict(row, ms=None, tflops=None, error=out.error))
                continue
            tflops = round(flops * factor / (ms * 1e-3) / 1e12, 1)
            row.update(ms=round(ms, 4), tflops=tflops, rounds_ms=[round(t, 4) for t in times])
            if which == "forward":
                row["max_abs_err_vs_fp32"] = round(out.max_abs_err_vs_fp32, 5)
            elif key in compared:
                diff = relative_grad_difference(out.grads, outcomes[compared[key]].grads)
                assert diff < GRAD_RTOL, f"{key}'s gradients differ from {compared[key]}'s by {diff:.3g} (relative)"
                row["max_rel_grad_diff_vs_flashtile"] = round(diff, 5)
            rows.append(row)
    return rows


def main_for(table: str, doc: str, cases: dict, measure_case, default_out, rounds: int, method: str, argv) -> None:
    """``python -m flashtile.bench <table>``: every case of ``cases`` (or ``--cases``), ``--rounds`` rounds,
    the rows saved to ``--out`` (``default_out``) with ``method`` in the provenance."""
    parser = argparse.ArgumentParser(prog=f"python -m flashtile.bench {table}", description=doc.splitlines()[0])
    parser.add_argument("--out", default=str(default_out))
    parser.add_argument("--cases", nargs="+", choices=list(cases), default=list(cases))
    parser.add_argument("--rounds", type=int, default=rounds)
    args = parser.parse_args(argv)
    rows = []
    for name in args.cases:
        rows += measure_case(name, args.rounds)
        torch.cuda.empty_cache()
    save_result(args.out, rows, method, cases={n: cases[n] for n in args.cases})
