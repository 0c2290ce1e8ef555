"""The practice battery: every step's cases, written once, run against any implementation.

An implementation is a plain Python module (the package's own, or a file the reader wrote after
``python -m flashtile.practice init``). Each step names the functions it calls on that module, and
its cases build inputs, call them and compare with the float64 truth of ``flashtile.practice.truth``.
Nothing here imports the rest of flashtile: the battery judges the package's code, it must not borrow
from it.

A case that fails raises ``PracticeFailure`` (or whatever the implementation raised); the runner
records which case it was, the error, and a hint. The hint comes from the symptom where one is
recognised (an lse off by a factor ln 2, an output that is right for the other alignment or the
default scale, NaN only on rows that see no key, errors only on rows whose max grew after the first
tile, ...), and from the case otherwise.
"""

from __future__ import annotations

import math
import traceback
import tracemalloc
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import ModuleType

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .truth import (
    attention_grads_truth,
    attention_truth,
    backward_equations,
    logsumexp_truth,
    softmax_truth,
    visible,
)

SITE = "https://flashtile.github.io/flashtile/"

# --8<-- [start:hint]
@dataclass(frozen=True)
class Hint:
    """What a failing case says about the mistake, in two levels: ``nudge`` names the
    symptom and where to look, ``formula`` (``--hint formula``) adds the formula.
    ``name`` identifies the rule that chose it; "none" is the honest answer when no rule
    fits: what differs, and no guess."""

    name: str
    nudge: str
    formula: str = ""

    def text(self, level: str = "nudge") -> str:
        if level == "formula" and self.formula:
            return f"{self.nudge}\n         formula: {self.formula}"
        return self.nudge

    def __str__(self) -> str:
        return self.nudge
# --8<-- [end:hint]


def no_diagnosis(what_differs: str) -> Hint:
    """The hint when no symptom rule fits: what differs, where and by how much, and no guess."""
    return Hint("none", f"no diagnosis (no known mistake gives this output): {what_differs}")


HINT_RESCALE = Hint(
    "rescale", "wrong exactly on the rows whose running max grew after the first block: what was kept from earlier "
    "blocks was not moved onto the new max; look at the update of l (and acc) where m grows",
    "alpha = exp(m - m_new); l = alpha * l + rowsum(exp(x - m_new)), and acc = alpha * acc + exp(s - m_new) V")
HINT_RESCALE_L = Hint(
    "rescale_l", "your output is what a forward gives that rescales acc but not l when the max grows: look at the "
    "update of l", "l = exp(m - m_new) * l + rowsum(p), with p = exp(s - m_new)")
HINT_RESCALE_ACC = Hint(
    "rescale_acc", "your output is what a forward gives that rescales l but not acc when the max grows: look at the "
    "update of acc", "acc = exp(m - m_new) * acc + p V, the same factor as l's")
HINT_NORMALISED_ACC = Hint(
    "normalised_acc", "your output is what a forward gives that divides acc by l on every tile and feeds the "
    "normalised acc to the next tile: look at where acc is divided by l",
    "keep acc unnormalised in the loop (acc = alpha * acc + p V) and divide once after the last tile: o = acc / l")
HINT_NEG_INF = Hint(
    "neg_inf", "NaN only on rows that had seen no finite score (m = -inf): exp(-inf - (-inf)) = NaN; look at every "
    "exp(a - m) where m can still be -inf, and at a row that sees no key at all",
    "subtract 0 where m = -inf (then alpha = p = 0); a row that sees no key gets o = 0 and lse = -inf")
HINT_NEG_INF_BACKWARD = replace(
    HINT_NEG_INF, nudge="NaN in the gradients, and some rows see no key (lse = -inf): P = exp(S - lse) on such a row "
    "is exp(-inf - (-inf)) = NaN; look where P is recomputed from lse",
    formula="where lse = -inf, subtract +inf instead (or mask the row): P = 0, and the row's gradients are 0")
HINT_MAX = Hint(
    "max", "non-finite values where a score passes exp's range (88 in float32, 709 in float64): look at the exp of "
    "the scores", "exp(s - m) with m the running max: every exponent is <= 0 and never overflows")
HINT_SKIP = Hint(
    "tile_count", "your output is attention without the last key tile that a query tile needs (rows short of their "
    "last visible keys): look at the causal loop's bound",
    "the last row q_end - 1 sees keys up to q_end - 1 + offset: key tiles 0 .. (q_end - 1 + offset) // block_k")
HINT_SKIPPED_TILE_READ = Hint(
    "skipped_tile_read", "NaN appears when the key tiles no row may see hold NaN, and your output is right without "
    "it: those tiles are loaded; look at the loop's bound under causal",
    "stop at the tile of key q_end - 1 + offset; never load a tile with k_start > q_end - 1 + offset")


def skipped_tiles_hint(loops: list[str]) -> Hint:
    """The backward's hint for NaN from the tiles no row sees, named by the loops that loaded them."""
    where = " and ".join(loops)
    return replace(HINT_SKIPPED_TILE_READ, nudge=f"NaN appears when the key tiles no row may see hold NaN, and your "
                   f"gradients are right without it: those tiles are loaded; look at {where} under causal",
                   formula="the key tile at k_start is seen from query row k_start - offset on; query row i sees keys "
                   "up to i + offset: never load a tile that no row of the program sees")


HINT_ALIGNMENT = Hint(
    "alignment", "your output is the other alignment's: look at the causal mask's offset",
    "query i sees key j iff j <= i + offset, offset = 0 for 'upper_left' and Tk - Tq for 'lower_right'")
HINT_STRICT_MASK = Hint(
    "strict_mask", "your output is attention under a causal mask that also hides the diagonal (j < i + offset): a "
    "query does not see its own key; look at the mask's comparison",
    "visible iff j <= i + offset: the diagonal is visible")
SCALE_FORMULA = "s = τ q kᵀ with τ the scale you are given (1/sqrt(D) only when scale is None), applied once"
HINT_SCALE = Hint(
    "scale", "your output is attention at another temperature than τ: look where the scores are scaled",
    SCALE_FORMULA)
HINT_TEMP_LOG2E = Hint(
    "temperature_log2e", "your output is attention at temperature τ·log2(e): exp (base e) applied to scores already "
    "multiplied by log2(e), which is exp2's scaling; look at exp against exp2",
    "either p = exp(τ s - m), or p = exp2(τ log2(e) s - m2) with m2 in the same log2 units; never exp of log2 units")
HINT_TEMP_LN2 = Hint(
    "temperature_ln2", "your output is attention at temperature τ·ln 2: exp2 applied to scores without the factor "
    "log2(e); look at the scale passed to the kernel (qk_scale)",
    "exp(x) = exp2(x log2(e)): qk_scale = τ log2(e), and m, l in those units")
UNITS_FORMULA = ("lse = m + ln l in natural units; from log2 units (m2 = m log2(e), l summed with exp2): "
                 "lse = (m2 + log2 l) ln 2")
HINT_UNITS = Hint(
    "log_base", "o is right and lse is off by a factor log2(e) or ln 2: lse is in the wrong log base; look at the "
    "lines that compute lse", UNITS_FORMULA)
HINT_LSE = Hint(
    "lse_precision", "every error is within a 16-bit rounding (2^-7 relative): statistics or lse were rounded to 16 "
    "bits; look at the dtypes of m, l and lse",
    "keep m, l and lse in float32 (float64 for float64 inputs), whatever the inputs' dtype")
HINT_MASK_BACKWARD = Hint(
    "mask_backward", "your gradients are the backward's equations with no mask on the recomputed P: hidden keys get "
    "P > 0; look where P = exp(S - lse) is recomputed", "P = exp(S - lse) where visible, 0 where the forward masked")
HINT_DELTA_TILE = Hint(
    "delta_tile", "your dQ and dK (or one of them) are what D summed over the current key tile only gives: D is a "
    "whole-row quantity; look at where D is computed",
    "D_i = rowsum(dO * O)_i, one number per query row, computed once before the tiles")
HINT_DELTA_MISSING = Hint(
    "delta_missing", "your dQ and dK are what dS = P * dP without D gives: look at dS",
    "dS = P * (dP - D) with D = rowsum(dO * O)")
HINT_PADDED = Hint(
    "padded_keys", "your output is attention with the padded keys (columns j >= Tk of the last tile) scoring 0: look "
    "at the mask of the last key tile", "s = tl.where(j[None, :] < Tk, s, float('-inf'))")
HINT_STRIDES = Hint(
    "strides", "your output is attention over the same memory read as a contiguous (B, H, T, D) tensor: look at the "
    "pointer arithmetic", "offsets from the tensors' own strides: b * q.stride(0) + h * q.stride(1) + t * q.stride(2)")
HINT_BATCH = Hint(
    "batch", "batch 0 is right and a later batch is not: look at the grid and the batch offset",
    "a grid axis for b, and pointers offset by b * stride_b + h * stride_h (not (b * H + h) * stride_h)")
HINT_MEMORY = Hint(
    "memory", "your forward creates a tensor or product wider than a tile: look for the whole score matrix or a "
    "block_q x Tk strip", "keep only (m, l, acc) per query tile and one (block_q, block_k) tile of scores")
HINT_MEMORY_BACKWARD = Hint(
    "memory_backward", "your backward creates a tensor or product wider than a tile (autograd through a full softmax "
    "forms all of P): look for a Tq x Tk matrix",
    "recompute P one (block_q, block_k) tile at a time from q, k and lse; dS = P * (dP - D), D = rowsum(dO * O)")
HINT_ARANGE = Hint(
    "arange", "Triton refused a tl.arange length: it must be a power of two; look at BLOCK",
    "BLOCK = triton.next_power_of_2(n_cols), the extra lanes masked (loaded as -inf)")
HINT_EXIT = Hint(
    "exit", "your code ended the process (sys.exit or raise SystemExit): return the results instead")


def factor_hint(name: str, factor: float, tau: float) -> Hint:
    """The hint for one gradient off by a constant factor, named when it is τ's."""
    known = {"τ": tau, "1/τ": 1 / tau, "-1": -1.0, "2": 2.0, "1/2": 0.5}
    said = next((f" = {k}" for k, v in known.items() if math.isclose(factor, v, rel_tol=1e-6)), "")
    why = {" = 1/τ": f"τ missing from {name}", " = τ": f"τ applied twice in {name}"}.get(said, "a constant factor")
    return Hint("factor", f"{name} is the truth times {factor:.6g}{said} ({why}), the other gradients are right: "
                f"look at the line that accumulates {name}", "dQ = τ dS K, dK = τ dSᵀ Q, dV = Pᵀ dO")


def units_hint(a: float, b: float) -> Hint:
    """The hint for an lse that is a * m + b * ln l with (a, b) != (1, 1)."""
    names = {1.0: "natural", math.log2(math.e): "times log2(e)", math.log(2): "times ln 2", 0.0: "missing"}
    word = lambda x: next((n for v, n in names.items() if math.isclose(x, v, abs_tol=1e-6)), f"times {x:.4g}")
    if math.isclose(a, b, abs_tol=1e-6):
        return replace(HINT_UNITS, nudge=f"o is right and lse is the truth {word(a)}: lse is in the wrong log base; "
                                         "look at the lines that compute lse")
    return replace(HINT_UNITS, nudge=f"o is right and lse mixes log bases: its m term is {word(a)} and its log l term "
                                     f"is {word(b)}; look at the lines that compute lse")

EXP_LIMIT = {torch.float64: 709.78, torch.float32: 88.72}  # exp overflows past these


class PracticeFailure(AssertionError):
    """A case's check failed; ``hint`` is what a symptom rule recognised (None: none did), ``differs`` what
    differs from the truth, where and by how much (for the hint when no rule fits)."""

    def __init__(self, message: str, hint: Hint | None = None, differs: str | None = None):
        super().__init__(message)
        self.hint, self.differs = hint, differs


class ReaderError(Exception):
    """What the reader's code did in the worker process, as the checker saw it: the error it raised (already
    formatted, with the reader's file and line), a time limit passed, or the process ended."""

    def __init__(self, error: str, hint: Hint | None = None, unwritten: bool = False, exited: bool = False):
        super().__init__(error)
        self.error, self.hint, self.unwritten, self.exited = error, hint, unwritten, exited


class Sandboxed:
    """A module whose functions run in another process; ``measured`` asks that process for the footprint,
    ``grad_call`` for a call and its gradients (see ``grad_call``)."""

    def measured(self, thunk: Callable[[], object]):
        raise NotImplementedError

    def grad_call(self, name: str, args: tuple, kwargs: dict, wrt: list[int], do: torch.Tensor):
        raise NotImplementedError


# --8<-- [start:grad_call]
def grad_call(function, args, kwargs, wrt, do):
    """``function(*args, **kwargs)`` with args[i] (i in ``wrt``) as leaves that require
    a gradient, then the gradients of its output (the first element of a tuple) against
    dO: (output, grads or None when the output carries no gradient, total bytes autograd
    saved for the backward, the most elements of one saved tensor). Runs where the
    function runs (the worker), since a graph cannot cross processes."""
    args = list(args)
    for i in wrt:
        args[i] = args[i].detach().clone().requires_grad_()
    storages: dict[int, int] = {}
    largest = 0

    def pack(t):
        nonlocal largest
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        largest = max(largest, t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = function(*args, **kwargs)
    o = out[0] if isinstance(out, tuple | list) and out else out
    grads = None
    if isinstance(o, torch.Tensor) and o.grad_fn is not None:
        grads = tuple(
            torch.autograd.grad(o, [args[i] for i in wrt], do, allow_unused=True)
        )
    return out, grads, sum(storages.values()), largest
# --8<-- [end:grad_call]


def call_with_grads(impl, name: str, args: tuple, kwargs: dict, wrt: list[int], do: torch.Tensor):
    """``grad_call`` of the implementation's function ``name``, where the implementation runs."""
    if isinstance(impl, Sandboxed):
        return impl.grad_call(name, args, kwargs, wrt, do)
    return grad_call(getattr(impl, name), args, kwargs, wrt, do)


def measured(impl, thunk: Callable[[], object]):
    """(thunk(), the Footprint of the implementation's calls in it), measured where the implementation runs."""
    if isinstance(impl, Sandboxed):
        return impl.measured(thunk)
    with Footprint() as footprint:
        out = thunk()
    return out, footprint


@dataclass(frozen=True)
class Case:
    name: str  # what makes this case special: shapes, alignment, block sizes
    run: Callable[[ModuleType], None]  # raises on failure
    fast: bool = True  # kept by --fast


@dataclass(frozen=True)
class Step:
    name: str
    file: str  # the reader's module, DIR/<file>.py
    package_module: str  # where the package keeps the same functions
    functions: tuple[str, ...]
    chapter: str  # site-relative URL of the chapter section that derives the idea
    summary: str
    cases: Callable[[], list[Case]] = field(repr=False)
    triton: bool = False


@dataclass
class Failure:
    case: str
    error: str
    hint: Hint
    chapter: str


@dataclass
class StepResult:
    step: Step
    passed: int = 0
    failures: list[Failure] = field(default_factory=list)
    skipped: int = 0  # cases not run after an unimplemented function or the first failure

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def total(self) -> int:
        return self.passed + len(self.failures) + self.skipped


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def randn(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    runs, out = [], []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    for a, b in runs[:4]:
        out.append(f"{a}" if a == b else f"{a}-{b}")
    return ", ".join(out) + (", ..." if len(runs) > 4 else "")


# --8<-- [start:differs]
def what_differs(
    name: str, actual: torch.Tensor, expected: torch.Tensor, atol: float
) -> str:
    """Where actual misses expected (the indices along each dimension that hold a wrong
    entry) and by how much (the largest error; the ratio got / expected when it is the
    same on every wrong entry)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    wrong = wrong_entries(a, e, atol)
    if not wrong.any():
        return f"{name} matches the truth"
    where = []
    for dim in range(wrong.dim()):
        hit = (
            wrong.movedim(dim, 0)
            .reshape(wrong.shape[dim], -1)
            .any(-1)
            .nonzero()
            .flatten()
            .tolist()
        )
        size = wrong.shape[dim]
        where.append(
            "all" if len(hit) == size and size > 1 else f"{_ranges(hit)} of {size}"
        )
    parts = [
        f"{name}: {int(wrong.sum())} of {wrong.numel()} entries wrong, at "
        f"[{'; '.join(where)}] (indices along each dimension)"
    ]
    nan, neginf = (
        int(torch.isnan(a[wrong]).sum()),
        int((torch.isneginf(a) & wrong).sum()),
    )
    if nan or neginf:
        parts.append(f"{nan} NaN and {neginf} -inf among them")
    finite = wrong & torch.isfinite(a) & torch.isfinite(e)
    if finite.any():
        parts.append(f"largest error {(a - e)[finite].abs().max().item():.3g}")
        nonzero = finite & (e.abs() > 1e-12)
        if nonzero.any():
            ratio = a[nonzero] / e[nonzero]
            lo, hi = ratio.min().item(), ratio.max().item()
            # one constant, within the rounding judged
            if hi - lo <= max(1e-6, atol) * max(abs(lo), abs(hi)):
                # float32 answers: the ratio's last digits are rounding
                digits = 6 if atol < 1e-6 else 4
                parts.append(
                    f"every wrong entry is the truth times {(lo + hi) / 2:.{digits}g}"
                )
            else:
                parts.append(f"got / expected from {lo:.3g} to {hi:.3g}")
    return "; ".join(parts)
# --8<-- [end:differs]


def compare(name: str, actual, expected, atol: float, hint: Hint | None = None) -> None:
    """actual equals expected (float64) within atol + atol * |expected|, with the same -inf entries."""
    if not isinstance(actual, torch.Tensor):
        raise PracticeFailure(f"{name}: expected a tensor, got {type(actual).__name__}", hint,
                              f"{name} is a {type(actual).__name__}, not a tensor")
    if tuple(actual.shape) != tuple(expected.shape):
        raise PracticeFailure(f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}", hint,
                              f"{name} has shape {tuple(actual.shape)}, the truth {tuple(expected.shape)}")
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    differs = lambda: what_differs(name, a, e, atol)  # noqa: E731
    if torch.isnan(a).any() and not torch.isnan(e).any():
        first = torch.isnan(a).nonzero()[0].tolist()
        raise PracticeFailure(f"{name}: {int(torch.isnan(a).sum())} NaN entries (first at {first}), the truth has none",
                              hint, differs())
    if not torch.equal(torch.isneginf(a), torch.isneginf(e)):
        where = (torch.isneginf(a) != torch.isneginf(e)).nonzero()[0].tolist()
        raise PracticeFailure(f"{name}: -inf pattern differs at {where}: got {a[tuple(where)].item()}, "
                              f"expected {e[tuple(where)].item()}", hint, differs())
    finite = torch.isfinite(e)
    err = (a[finite] - e[finite]).abs()
    bound = atol + atol * e[finite].abs()
    if (err > bound).any() or err.isnan().any():
        worst = int(torch.where(err.isnan(), torch.inf, err - bound).argmax())
        where = finite.nonzero()[worst].tolist()
        got, want = a[tuple(where)].item(), e[tuple(where)].item()
        digits = ".6g" if f"{got:.6g}" != f"{want:.6g}" else ".12g"  # enough digits to show the difference
        # a result in a narrower dtype than the float64 truth: its rounding alone can pass the tolerance
        narrow = (f"; {name} is {str(actual.dtype).replace('torch.', '')}, the truth float64: compute in the "
                  "inputs' dtype" if actual.dtype != expected.dtype and actual.is_floating_point() else "")
        raise PracticeFailure(f"{name}: max abs error {err.max().item():.3g} > tolerance {atol:g} "
                              f"(worst at {where}: got {got:{digits}}, expected {want:{digits}}){narrow}", hint,
                              differs())


def check_dtype(name: str, t, dtype, hint: Hint | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise PracticeFailure(f"{name}: expected a tensor, got {type(t).__name__}", None,
                              f"{name} is a {type(t).__name__}, not a tensor")
    if t.dtype != dtype:
        raise PracticeFailure(f"{name} has dtype {t.dtype}, expected {dtype}", hint,
                              f"{name} has dtype {t.dtype}, the truth's is {dtype}")


# ---------------------------------------------------------------------------------------------------
# Symptoms: what a wrong answer looks like says which idea is missing
# ---------------------------------------------------------------------------------------------------
def wrong_entries(actual: torch.Tensor, expected: torch.Tensor, atol: float) -> torch.Tensor:
    """Boolean, expected's shape: True where actual misses expected (NaN, -inf pattern or tolerance)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    both_neginf = torch.isneginf(a) & torch.isneginf(e)
    close = (a - e).abs() <= atol + atol * e.abs()
    return ~(both_neginf | close | (torch.isnan(a) & torch.isnan(e)))


def matches(actual, expected, atol: float) -> bool:
    return (isinstance(actual, torch.Tensor) and tuple(actual.shape) == tuple(expected.shape)
            and not wrong_entries(actual, expected, atol).any())


def grows_after_first_block(x: torch.Tensor, block: int) -> torch.Tensor:
    """Rows (x.shape[:-1]) whose running max rises in a block after the first one, where rescaling matters."""
    first = x[..., :block].amax(dim=-1)
    later = x[..., block:].amax(dim=-1) if x.shape[-1] > block else torch.full_like(first, float("-inf"))
    return later > first


# --8<-- [start:symptom]
def rescale_symptom(wrong_rows: torch.Tensor, growing_rows: torch.Tensor) -> bool:
    """Wrong exactly where it matters: some rows wrong, every wrong row's max grew after
    its first block, and some rows whose max did not grow are right (so the evidence is
    not just 'everything is wrong')."""
    return bool(
        wrong_rows.any()
        and not (wrong_rows & ~growing_rows).any()
        and (~growing_rows).any()
    )


@dataclass
class AttentionInputs:
    """What a forward case passed, and what its truth needs to test the symptoms'
    hypotheses."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool
    scale: float | None
    alignment: str
    block_k: int
    atol: float
    compute: torch.dtype  # the dtype the statistics should be computed in
    block_q: int | None = None

    @property
    def tau(self) -> float:
        return 1.0 / math.sqrt(self.q.shape[-1]) if self.scale is None else self.scale

    def truth(self, **change):
        a = replace(self, **change)
        return attention_truth(a.q, a.k, a.v, a.causal, a.scale, a.alignment)

    def visible(self) -> torch.Tensor:
        return visible(self.q.shape[-2], self.k.shape[-2], self.causal, self.alignment)

    def masked_truth(self, mask: torch.Tensor):
        """(o, lse) of attention under another visibility ``mask`` (Tq, Tk) or (..., Tq,
        Tk)."""
        return attention_truth(self.q, self.k, self.v, scale=self.scale, mask=mask)

    def scores(self) -> torch.Tensor:
        """The float64 scores τ q kᵀ with hidden keys at -inf."""
        q, k = self.q.double().cpu(), self.k.double().cpu()
        s = self.tau * q @ k.transpose(-1, -2)
        return s.masked_fill(~self.visible(), float("-inf"))

    def other_scales(self) -> list[tuple[float, Hint]]:
        """The temperatures a mistake gives instead of τ, each with the hint that names
        the mistake."""
        d, tau = 1.0 / math.sqrt(self.q.shape[-1]), self.tau
        log2e, ln2 = math.log2(math.e), math.log(2.0)

        def scale_hint(label: str) -> Hint:
            return replace(
                HINT_SCALE,
                nudge=f"your output is attention at temperature {label} instead of τ = "
                f"{tau:.6g}: look where the scores are scaled",
            )

        found = [
            (tau * log2e, HINT_TEMP_LOG2E),
            (tau * ln2, HINT_TEMP_LN2),
            (d, scale_hint("1/sqrt(D) (the default: the given scale ignored)")),
            (1.0, scale_hint("1 (the scores never scaled)")),
            (tau * tau, scale_hint("τ² (τ applied twice)")),
            (tau * d, scale_hint("τ/sqrt(D) (both the given scale and the default)")),
            (d * log2e, HINT_TEMP_LOG2E),
            (d * ln2, HINT_TEMP_LN2),
        ]
        return [(t, h) for t, h in found if not math.isclose(t, tau)]


def simulated_forward(
    a: AttentionInputs, rescale_l=True, rescale_acc=True, normalise=None
):
    """(o, lse) in float64 of a tiled forward with a known mistake: the key tiles of
    block_k in order, every row at once (a row's result does not depend on block_q).
    normalise: "each" divides acc by l on every tile and returns acc; "each_and_end"
    divides once more at the end."""
    s, v = a.scores(), a.v.double().cpu()
    m = torch.full(s.shape[:-1], float("-inf"), dtype=torch.float64)
    l = torch.zeros_like(m)
    acc = torch.zeros((*s.shape[:-1], v.shape[-1]), dtype=torch.float64)
    safe = lambda t: torch.where(t == 0, 1.0, t)  # noqa: E731
    for k0 in range(0, s.shape[-1], a.block_k):
        tile = s[..., k0:k0 + a.block_k]
        m_new = torch.maximum(m, tile.amax(-1))
        m_sub = torch.where(torch.isneginf(m_new), 0.0, m_new)
        alpha, p = torch.exp(m - m_sub), torch.exp(tile - m_sub[..., None])
        l = (alpha * l if rescale_l else l) + p.sum(-1)
        acc = (alpha[..., None] * acc if rescale_acc else acc) + p @ v[
            ..., k0 : k0 + a.block_k, :
        ]
        if normalise:
            acc = acc / safe(l)[..., None]
        m = m_new
    o = acc if normalise == "each" else acc / safe(l)[..., None]
    return o, torch.where(l == 0, float("-inf"), m + torch.log(safe(l)))


def rows_explained(o, lse, o_ref, lse_ref, o_alt, lse_alt, atol) -> bool:
    """Every row of (o, lse) is the truth's or the alternative's (NaN allowed where the
    alternative's row sees no key: an unguarded exp there), some row is not the truth's,
    and the alternative is not the truth."""
    def row_ok(o_x, lse_x):
        return ~(wrong_entries(o, o_x, atol).any(-1) | wrong_entries(lse, lse_x, atol))
    nan = torch.isnan(o).any(-1) | torch.isnan(lse)
    alt = row_ok(o_alt, lse_alt) | (nan & torch.isneginf(lse_alt))
    right = row_ok(o_ref, lse_ref)
    alt_differs = wrong_entries(o_alt, o_ref, atol).any(-1) | wrong_entries(
        lse_alt, lse_ref, atol
    )
    return bool(
        (right | alt).all()
        and (~right).any()
        and (alt & ~right).any()
        and alt_differs.any()
    )


def last_tile_dropped(a: AttentionInputs) -> torch.Tensor:
    """The causal mask without the last key tile each query tile needs (a tile count one
    short)."""
    Tq, Tk = a.q.shape[-2], a.k.shape[-2]
    keep = a.visible().clone()
    offset = 0 if a.alignment == "upper_left" else Tk - Tq
    for q0 in range(0, Tq, a.block_q):
        last = min(q0 + a.block_q, Tq) - 1 + offset
        if last >= 0:
            keep[
                q0 : q0 + a.block_q, (min(last, Tk - 1) // a.block_k) * a.block_k :
            ] = False
    return keep


def lse_units_symptom(lse64, lse_ref, m, atol) -> Hint | None:
    """lse = a * m + b * ln l (m the row max, l the row sum at that max) with a or b a
    wrong log factor."""
    finite = torch.isfinite(lse_ref) & torch.isfinite(m)
    if not finite.any():
        return None
    got, m, ln_l = lse64[finite], m[finite], (lse_ref - m)[finite]
    factors = (1.0, math.log2(math.e), math.log(2.0), 0.0)
    for a in factors:
        for b in factors:
            if (
                (a, b) != (1.0, 1.0)
                and matches(got, a * m + b * ln_l, atol)
                and not matches(lse_ref[finite], a * m + b * ln_l, atol)
            ):
                return units_hint(a, b)
    return None


def attention_symptom(a: AttentionInputs, o, lse) -> Hint | None:
    """The hint a wrong (o, lse) points at, or None when no rule fits (then the failure
    says what differs)."""
    o_ref, lse_ref = a.truth()
    if not (isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor)
            and o.shape == o_ref.shape and lse.shape == lse_ref.shape):
        return None
    o64, lse64 = o.detach().double().cpu(), lse.detach().double().cpu()
    wrong_rows = wrong_entries(o64, o_ref, a.atol).any(-1) | wrong_entries(
        lse64, lse_ref, a.atol
    )
    # before NaN: a batch never written may hold any bytes
    if o64.shape[0] >= 2 and not wrong_rows[0].any():
        return HINT_BATCH

    def explained(alt):  # every row is the truth's or the alternative's
        return rows_explained(o64, lse64, o_ref, lse_ref, *alt, a.atol)

    masks = []  # a mask with the diagonal hidden, a causal tile count one short
    if a.causal:
        Tq, Tk = a.q.shape[-2], a.k.shape[-2]
        offset = 0 if a.alignment == "upper_left" else Tk - Tq
        diagonal = torch.arange(Tk)[None, :] - torch.arange(Tq)[:, None] == offset
        masks.append((HINT_STRICT_MASK, a.visible() & ~diagonal))
        if a.block_q:
            masks.append((HINT_SKIP, last_tile_dropped(a)))
    nan_rows = torch.isnan(o64).any(-1) | torch.isnan(lse64)
    overflow = a.scores().max().item() > EXP_LIMIT.get(
        a.compute, EXP_LIMIT[torch.float32]
    )
    # NaN: the rows that see no key (a missing guard), or exp overflowing (no max)
    if nan_rows.any():
        empty = torch.isneginf(lse_ref)
        if not (nan_rows & ~empty).any():
            return HINT_NEG_INF
        for hint, mask in masks:  # rows a wrong mask leaves without a key, unguarded
            if explained(a.masked_truth(mask)):
                return hint
        return HINT_MAX if overflow else None
    if overflow and not torch.isfinite(o64).all():
        return HINT_MAX
    if not wrong_entries(o64, o_ref, a.atol).any():  # o right, lse wrong: its log base
        units = lse_units_symptom(lse64, lse_ref, a.scores().amax(-1), a.atol)
        if units is not None:
            return units

    # o is the alternative's, and the alternative is not the truth's
    def explains(alternative):
        return matches(o64, alternative, a.atol) and not matches(
            o_ref, alternative, a.atol
        )

    if a.causal and a.q.shape[-2] != a.k.shape[-2]:
        if explains(
            a.truth(
                alignment="lower_right" if a.alignment == "upper_left" else "upper_left"
            )[0]
        ):
            return HINT_ALIGNMENT
    for hint, mask in masks:
        if explained(a.masked_truth(mask)):
            return hint
    for tau, hint in a.other_scales():
        if explains(a.truth(scale=tau)[0]):
            return hint
    # the same memory read as if it were a contiguous (B, H, T, D) tensor
    if not a.q.is_contiguous():
        raw = [
            torch.as_strided(
                t, t.shape, torch.empty(t.shape).stride(), t.storage_offset()
            )
            for t in (a.q, a.k, a.v)
        ]
        if matches(o64, a.truth(q=raw[0], k=raw[1], v=raw[2])[0], a.atol):
            return HINT_STRIDES
    Tk = a.k.shape[-2]
    # padded keys loaded as 0 and never hidden: they score 0
    if not a.causal and Tk % a.block_k:
        pad = a.block_k - Tk % a.block_k
        k0, v0 = (
            torch.cat(
                [
                    t.double().cpu(),
                    t.new_zeros((*t.shape[:-2], pad, t.shape[-1])).double().cpu(),
                ],
                -2,
            )
            for t in (a.k, a.v)
        )
        if matches(o64, a.truth(k=k0, v=v0)[0], a.atol):
            return HINT_PADDED
    # within 2^-7 relative: what a 16-bit rounding does, not a missing idea
    def rounding_size(got, ref):
        return bool(((got - ref).abs() <= 2**-7 * (ref.abs() + 1)).all())

    finite = torch.isfinite(lse_ref)
    if rounding_size(o64, o_ref) and rounding_size(lse64[finite], lse_ref[finite]):
        return HINT_LSE
    for hint, mistake in [
        (HINT_RESCALE_L, dict(rescale_l=False)),
        (HINT_RESCALE_ACC, dict(rescale_acc=False)),
        (HINT_RESCALE, dict(rescale_l=False, rescale_acc=False)),
        (HINT_NORMALISED_ACC, dict(normalise="each")),
        (HINT_NORMALISED_ACC, dict(normalise="each_and_end")),
    ]:
        if explained(simulated_forward(a, **mistake)):
            return hint
    if rescale_symptom(wrong_rows, grows_after_first_block(a.scores(), a.block_k)):
        return HINT_RESCALE
    return None
# --8<-- [end:symptom]


def with_symptom(check: Callable[[], None], symptom: Callable[[], Hint | None]) -> None:
    """Run ``check``; if it fails, let the symptom rules choose the hint (None: no rule fits)."""
    try:
        check()
    except PracticeFailure as exc:
        try:
            exc.hint = symptom() or exc.hint
        except Exception:  # the diagnosis (which may call the implementation again) must not replace the failure
            pass
        raise


# ---------------------------------------------------------------------------------------------------
# Memory: the largest tensor an implementation creates, and the peak of Python's own allocations
# ---------------------------------------------------------------------------------------------------
class _Mode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: torch would otherwise wrap __torch_dispatch__ to disable Dynamo, which imports torch._dynamo
        (seconds, hundreds of modules) on the first operation; nothing compiles inside these modes."""
        return False


class _PassThrough(_Mode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def warm_up() -> None:
    """Enter a dispatch mode once in this process, so that the modules torch imports for the first one (tens
    of MB, seconds on a busy machine) are loaded before any case's memory or time is measured."""
    if not Footprint.warmed:
        Footprint.warmed = True
        with _PassThrough():
            torch.zeros(1).add_(1)


MATMULS = {"mm", "bmm", "addmm", "baddbmm", "matmul", "_scaled_mm"}  # the products a score tile comes from


class Footprint(_Mode):
    """Inside ``with Footprint() as f``: f.largest_tensor is the largest storage (bytes) any torch operation
    produced, f.python_peak the peak of memory traced by tracemalloc (numpy arrays and Python objects)."""

    def __init__(self):
        super().__init__()
        self.largest_tensor = 0
        self.python_peak = 0
        self.widest_product = (0, 0)  # (rows, columns) of the largest matrix product's output

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest_tensor = max(self.largest_tensor, t.untyped_storage().nbytes())
                if func.__name__.split(".")[0] in MATMULS and t.dim() >= 2:
                    shape = tuple(t.shape[-2:])
                    if shape[0] * shape[1] > self.widest_product[0] * self.widest_product[1]:
                        self.widest_product = shape
        return out

    warmed = False  # the first dispatch mode of a process imports torch's modules for it: tens of MB

    def __enter__(self):
        warm_up()  # before tracing starts: those imports are torch's, not the reader's
        self._started = not tracemalloc.is_tracing()
        if self._started:
            tracemalloc.start()
        self._base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self.python_peak = tracemalloc.get_traced_memory()[1] - self._base
        if self._started:
            tracemalloc.stop()
        return out


# ---------------------------------------------------------------------------------------------------
# Step 1: online softmax
# ---------------------------------------------------------------------------------------------------
def _stats_symptom(x: torch.Tensor, block: int, lse) -> Hint | None:
    truth = logsumexp_truth(x)
    if not isinstance(lse, torch.Tensor) or lse.shape != truth.shape:
        return None
    got = lse.detach().double().cpu()
    finite = torch.isfinite(x)
    largest = x[finite].abs().max().item() if finite.any() else 0.0
    if (~torch.isfinite(got) & torch.isfinite(truth)).any() or torch.isnan(got).any():
        if largest > EXP_LIMIT[torch.float64] and not torch.isnan(got).any():
            return HINT_MAX
        empty_first = torch.isneginf(x[..., :block]).all(-1)
        if torch.isnan(got).any() and (torch.isnan(got) <= (empty_first | torch.isneginf(truth))).all():
            return HINT_NEG_INF
        if largest > EXP_LIMIT[torch.float64]:
            return HINT_MAX
    units = lse_units_symptom(got, truth, x.amax(dim=-1), 1e-12)
    if units is not None:
        return units
    if matches(got, stats_without_rescale(x, block), 1e-12) or rescale_symptom(
            wrong_entries(got, truth, 1e-12), grows_after_first_block(x, block)):
        return HINT_RESCALE
    return None


def stats_without_rescale(x: torch.Tensor, block: int) -> torch.Tensor:
    """The lse that streaming x in blocks gives when l is never moved onto a new max (a known mistake)."""
    x = x.double()
    m = torch.full(x.shape[:-1], float("-inf"), dtype=torch.float64)
    l = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block):
        m = torch.maximum(m, x[..., start:start + block].amax(-1))
        safe = torch.where(torch.isneginf(m), 0.0, m)
        l = l + torch.exp(x[..., start:start + block] - safe[..., None]).sum(-1)
    return torch.where(l == 0, float("-inf"), m + torch.log(torch.where(l == 0, 1.0, l)))


def _stats_case(x: torch.Tensor, block: int):
    def run(impl):
        m, l = impl.online_softmax_stats(x, block)
        compare("m", m, x.amax(dim=-1), 0.0)
        lse = impl.lse_from_stats(m, l)
        with_symptom(lambda: compare("lse_from_stats(m, l)", lse, logsumexp_truth(x), 1e-12),
                     lambda: _stats_symptom(x, block, lse))
    return run


def nan_symptom(*values) -> Hint | None:
    """NaN where the inputs held an empty state (m = -inf): the unguarded exp(-inf - (-inf))."""
    return HINT_NEG_INF if any(isinstance(t, torch.Tensor) and torch.isnan(t).any() for t in values) else None


HINT_RAW_EXP = replace(HINT_MAX, nudge="your l adds exp(x) of the block's raw values, not exp(x - m_new): look "
                       "at the exp in the update")
HINT_MERGE_RESCALE = replace(HINT_RESCALE, nudge="your merge is l_a + l_b, each left on its own max: look at the "
                             "factors that move l_a and l_b onto the common max m = max(m_a, m_b)",
                             formula="l = exp(m_a - m) * l_a + exp(m_b - m) * l_b")


def _merge_case(x: torch.Tensor, cut: int, block: int):
    def run(impl):
        m_a, l_a = impl.online_softmax_stats(x[..., :cut], block)
        m_b, l_b = impl.online_softmax_stats(x[..., cut:], block)
        m, l = impl.merge(m_a, l_a, m_b, l_b)
        lse = impl.lse_from_stats(m, l)

        def symptom():
            m_a64, l_a64, m_b64, l_b64 = (t.double() for t in (m_a, l_a, m_b, l_b))
            if matches(lse, torch.maximum(m_a64, m_b64) + torch.log(l_a64 + l_b64), 1e-12):
                return HINT_MERGE_RESCALE
            if matches(lse, stats_without_rescale(x[..., :cut], block).logaddexp(
                    stats_without_rescale(x[..., cut:], block)), 1e-12):
                return HINT_RESCALE  # the merge is right; the stats it merged were streamed without rescale
            units = lse_units_symptom(lse.detach().double(), logsumexp_truth(x), x.amax(-1), 1e-12) if isinstance(
                lse, torch.Tensor) else None
            return units  # (neither state is empty here: a NaN is no -inf - (-inf))

        with_symptom(lambda: compare("lse of merge(left, right)", lse, logsumexp_truth(x), 1e-12), symptom)
        empty_m = torch.full_like(m_a, float("-inf"))
        m, l = impl.merge(empty_m, torch.zeros_like(l_a), m_a, l_a)
        lse = impl.lse_from_stats(m, l)
        with_symptom(lambda: compare("lse of merge(empty state, left)", lse, logsumexp_truth(x[..., :cut]), 1e-12),
                     lambda: nan_symptom(l, lse))
    return run


def _merge_empty_case(rows: int):
    """merge(empty, empty) is the empty state: m = -inf, l = 0 (exp(-inf - (-inf)) would make l NaN)."""
    def run(impl):
        empty = torch.full((rows,), float("-inf"), dtype=torch.float64)
        m, l = impl.merge(empty, torch.zeros(rows, dtype=torch.float64), empty.clone(),
                          torch.zeros(rows, dtype=torch.float64))
        lse = impl.lse_from_stats(m, l)
        with_symptom(lambda: (compare("m of merge(empty, empty)", m, empty, 0.0),
                              compare("l of merge(empty, empty)", l, torch.zeros(rows, dtype=torch.float64), 0.0),
                              compare("lse of merge(empty, empty)", lse, empty, 0.0)),
                     lambda: nan_symptom(m, l, lse))
    return run


def _update_case(x: torch.Tensor):
    def run(impl):
        m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype)
        m, l = impl.online_softmax_update(m, torch.zeros_like(m), x)
        lse = impl.lse_from_stats(m, l)
        truth = logsumexp_truth(x)
        with_symptom(lambda: compare("lse after one update from the empty state", lse, truth, 1e-12),
                     lambda: nan_symptom(l, lse) or (lse_units_symptom(lse.detach().double(), truth, x.amax(-1), 1e-12)
                                                     if isinstance(lse, torch.Tensor) else None))
    return run


def _update_from_state_case(seen: torch.Tensor, x: torch.Tensor):
    """The state (m, l) of the columns ``seen`` (computed here, from the definition), then one update."""
    def run(impl):
        m0 = seen.amax(dim=-1)
        l0 = torch.exp(seen - m0[..., None]).sum(dim=-1)
        m, l = impl.online_softmax_update(m0.clone(), l0.clone(), x)
        full = torch.cat([seen, x], dim=-1)
        compare("m after the update", m, full.amax(dim=-1), 0.0)
        got = m.double() + torch.log(l.double()) if isinstance(l, torch.Tensor) else l
        def symptom():
            m_new = full.amax(dim=-1)
            if matches(got, m_new + torch.log(l0 + torch.exp(x).sum(-1)), 1e-12):  # exp of the raw block
                return HINT_RAW_EXP
            wrong = wrong_entries(got, logsumexp_truth(full), 1e-12)
            return HINT_RESCALE if rescale_symptom(wrong, x.amax(-1) > m0) else None

        with_symptom(lambda: compare("m + log(l) after the update", got, logsumexp_truth(full), 1e-12), symptom)
    return run


# --8<-- [start:cases]
def online_softmax_cases() -> list[Case]:
    # a new max in every block
    rising = torch.linspace(-40.0, 1000.0, 37, dtype=torch.float64)
    # row 1's max is in its first block
    wide = torch.stack([rising, rising.flip(0), rising - 500.0])
    rows = randn(4, 37) * 5
    masked_prefix = rows.clone()
    masked_prefix[:, :9] = float("-inf")  # the first blocks hold nothing but -inf
    all_masked = torch.full((2, 10), float("-inf"), dtype=torch.float64)
    seen, new = (
        rows[:, :8],
        rows[:, 8:14]
        + torch.tensor([[9.0], [9.0], [-9.0], [-9.0]], dtype=torch.float64),
    )
    return [
        Case(
            "update from the empty state, one block of 8 columns",
            _update_case(rows[:, :8]),
        ),
        Case(
            "stats, rows of 37 columns between -40 and 1000 in blocks of 8 (exp(1000) "
            "overflows float64)",
            _stats_case(wide, 8),
        ),
        Case(
            "update from a state of 8 columns with 6 more: rows 0-1 get a new max, "
            "rows 2-3 do not",
            _update_from_state_case(seen, new),
        ),
        Case("stats, random rows of 37 columns in blocks of 5", _stats_case(rows, 5)),
        Case("stats, block of 1 column", _stats_case(rows, 1), fast=False),
        Case(
            "stats, block wider than the row (64 > 37)",
            _stats_case(rows, 64),
            fast=False,
        ),
        Case("stats, first 9 columns -inf, blocks of 4", _stats_case(masked_prefix, 4)),
        Case(
            "stats, 2 rows of 10 columns all -inf (lse must be -inf)",
            _stats_case(all_masked, 4),
        ),
        Case("merge two halves cut at column 13", _merge_case(rows, 13, 4)),
        Case(
            "merge two empty states of 3 rows (m = -inf, l = 0: nothing seen on either "
            "side)",
            _merge_empty_case(3),
        ),
    ]
# --8<-- [end:cases]


# ---------------------------------------------------------------------------------------------------
# Steps 2 and 3: the tiled forward, then causal masking and tile skipping
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    B: int
    H: int
    Tq: int
    Tk: int
    D: int
    block_q: int
    block_k: int
    causal: bool = False
    alignment: str = "upper_left"
    scale: float | None = None

    def __str__(self) -> str:
        mask = f"causal {self.alignment}" if self.causal else "no mask"
        tau = "" if self.scale is None else f", τ = {self.scale:g}"
        return (f"B={self.B} H={self.H} Tq={self.Tq} Tk={self.Tk} D={self.D}, block_q={self.block_q} "
                f"block_k={self.block_k}, {mask}{tau}")


def _qkv(s: Shape, dtype, seed=0, transposed=False, gain=1.0):
    """q, k, v of the case, on the device; transposed: (B, T, H, D) memory viewed as (B, H, T, D)."""
    def make(T, i):
        if transposed:
            return (randn(s.B, T, s.H, s.D, seed=seed + i) * gain).to(dtype).to(device()).transpose(1, 2)
        return (randn(s.B, s.H, T, s.D, seed=seed + i) * gain).to(dtype).to(device())
    return make(s.Tq, 0), make(s.Tk, 1), make(s.Tk, 2)


def _hidden_key_tiles(s: Shape) -> int:
    """The first key column of the tiles that no query row sees (Tk when there is none)."""
    offset = 0 if s.alignment == "upper_left" else s.Tk - s.Tq
    last_seen = s.Tq - 1 + offset
    return min(s.Tk, (last_seen // s.block_k + 1) * s.block_k)


# Memory budget of the tiled forward: no tensor bigger than MEMORY_FACTOR times the larger of q and one
# (block_q, block_k) float64 tile of scores; Python's own allocations (numpy, lists) under PYTHON_BUDGET.
MEMORY_FACTOR = 2
PYTHON_BUDGET = 1 << 19


def _forward_case(s: Shape, dtype=torch.float64, kernel=False, transposed=False, poison=False, memory=False,
                  gain=1.0, seed=0):
    """One forward case, for the PyTorch steps (``flash_attention_forward``) or the kernel step
    (``flash_attention``). poison: NaN in k and v where no query may look (so a skipped tile that is
    loaded anyway shows); memory: the footprint must stay under the tiled budget."""
    def call(impl, q, k, v):
        if kernel:
            return impl.flash_attention(q, k, v, causal=s.causal, scale=s.scale, alignment=s.alignment,
                                        block_q=s.block_q, block_k=s.block_k)
        return impl.flash_attention_forward(q, k, v, causal=s.causal, scale=s.scale, block_q=s.block_q,
                                            block_k=s.block_k, alignment=s.alignment)

    def run(impl):
        q, k, v = _qkv(s, dtype, seed, transposed, gain)
        low = dtype != torch.float64
        # float32 kernels: full-fp32 dots, but exp2 and the reduction order differ from the CPU's
        atol, lse_atol = {torch.float64: (1e-10, 1e-10), torch.float32: (5e-5, 5e-5),
                          torch.float16: (3e-3, 1e-4) if kernel else (2e-3, 1e-5)}[dtype]
        a = AttentionInputs(q, k, v, s.causal, s.scale, s.alignment, s.block_k, atol,
                            torch.float32 if low else torch.float64, s.block_q)
        o_ref, lse_ref = a.truth()
        if poison:
            start = _hidden_key_tiles(s)
            k_in, v_in = k.clone(), v.clone()
            k_in[..., start:, :] = float("nan")
            v_in[..., start:, :] = float("nan")
            out = call(impl, q, k_in, v_in)
        elif memory:
            out, footprint = measured(impl, lambda: call(impl, q, k, v))
        else:
            out = call(impl, q, k, v)
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise PracticeFailure(f"expected (o, lse), got {type(out).__name__}")
        o, lse = out
        check_dtype("o", o, dtype)
        lse_dtype = torch.float32 if low else torch.float64
        check_dtype("lse", lse, lse_dtype, HINT_LSE if getattr(lse, "dtype", None) in (torch.float16,
                                                                                       torch.bfloat16) else None)

        def symptom():
            if poison and (torch.isnan(o).any() or torch.isnan(lse).any()):
                o_clean, lse_clean = call(impl, q, k, v)  # the same call without the NaN: is that the only bug?
                if matches(o_clean, o_ref, a.atol) and matches(lse_clean, lse_ref, lse_atol):
                    return HINT_SKIPPED_TILE_READ
                return attention_symptom(a, o_clean, lse_clean)
            return attention_symptom(a, o, lse)

        with_symptom(lambda: (compare("o", o, o_ref, a.atol), compare("lse", lse, lse_ref, lse_atol)), symptom)
        if memory:
            budget = MEMORY_FACTOR * max(q.numel() * q.element_size(), s.block_q * s.block_k * 8)
            if footprint.largest_tensor > budget:
                raise PracticeFailure(
                    f"a tensor of {footprint.largest_tensor / 2**10:.0f} KiB was created; the tiled forward needs "
                    f"none over {budget / 2**10:.0f} KiB ({MEMORY_FACTOR} x the larger of q and one score tile; "
                    f"the full score matrix is {s.B * s.H * s.Tq * s.Tk * 8 / 2**10:.0f} KiB)", HINT_MEMORY)
            rows, cols = footprint.widest_product
            if rows * cols > s.block_q * max(s.block_k, s.D):
                raise PracticeFailure(
                    f"a matrix product gave a ({rows}, {cols}) output; a tiled forward's products are one score tile "
                    f"(block_q, block_k) = ({s.block_q}, {s.block_k}) or one P V tile (block_q, D) = ({s.block_q}, "
                    f"{s.D}): that is not FlashAttention's tiling", HINT_MEMORY)
            if footprint.python_peak > PYTHON_BUDGET:
                raise PracticeFailure(
                    f"Python allocations peaked at {footprint.python_peak / 2**10:.0f} KiB (numpy arrays, lists), "
                    f"over {PYTHON_BUDGET / 2**10:.0f} KiB", HINT_MEMORY)
    return run


def forward_cases() -> list[Case]:
    big = Shape(1, 1, 512, 512, 8, 128, 128)
    return [
        Case(f"{Shape(1, 2, 32, 32, 8, 16, 16)} (blocks divide T)", _forward_case(Shape(1, 2, 32, 32, 8, 16, 16))),
        Case(f"{Shape(1, 2, 20, 37, 8, 16, 16)} (Tq != Tk, blocks do not divide them)",
             _forward_case(Shape(1, 2, 20, 37, 8, 16, 16))),
        Case(f"{Shape(2, 1, 9, 33, 4, 4, 8)} (block_q != block_k)", _forward_case(Shape(2, 1, 9, 33, 4, 4, 8)),
             fast=False),
        Case(f"{Shape(1, 2, 16, 24, 8, 8, 8, scale=60.0)} (scores reach ±900: exp overflows even float64)",
             _forward_case(Shape(1, 2, 16, 24, 8, 8, 8, scale=60.0), gain=1.5)),
        Case(f"{Shape(1, 1, 24, 200, 16, 8, 8)}, float16 inputs (m, l and lse in float32)",
             _forward_case(Shape(1, 1, 24, 200, 16, 8, 8), dtype=torch.float16)),
        Case(f"{big} (memory: the full score matrix would be 2 MiB)", _forward_case(big, memory=True)),
        Case(f"{Shape(1, 2, 64, 64, 8, 16, 16)} (T a multiple of every tile; tiled: no product wider than a tile)",
             _forward_case(Shape(1, 2, 64, 64, 8, 16, 16), memory=True)),
    ]


def causal_cases() -> list[Case]:
    shapes = [
        (Shape(1, 2, 32, 32, 8, 16, 16, True), "blocks divide T", True),
        (Shape(1, 2, 37, 37, 8, 16, 16, True), "ragged last tiles", True),
        (Shape(1, 2, 37, 37, 8, 8, 16, True), "block_q < block_k", False),
        (Shape(1, 2, 20, 37, 8, 16, 8, True, "lower_right", 0.5), "Tq < Tk: the diagonal ends bottom-right", True),
        (Shape(1, 2, 40, 13, 8, 16, 16, True, "lower_right"), "the first 27 rows see no key", True),
    ]
    cases = [Case(f"{s} ({why})", _forward_case(s), fast) for s, why, fast in shapes]
    # lengths that are multiples of every tile size in use (16, 32, 64, 128), each alignment, measured for tiling
    for s, why in [(Shape(1, 2, 64, 64, 8, 16, 16, True), "Tq = Tk = 64"),
                   (Shape(1, 1, 128, 128, 8, 32, 32, True, "lower_right"), "Tq = Tk = 128"),
                   (Shape(1, 1, 64, 128, 8, 16, 32, True, "lower_right"), "Tq = 64 < Tk = 128"),
                   (Shape(1, 1, 128, 64, 8, 32, 16, True, "upper_left"), "Tq = 128 > Tk = 64")]:
        cases.append(Case(f"{s} ({why}: lengths a multiple of the tiles; tiled)", _forward_case(s, memory=True)))
    poisoned = Shape(1, 1, 20, 64, 8, 16, 16, True, "upper_left")
    cases.append(Case(f"{poisoned} (Tq < Tk: key tiles 2-3 are seen by no row and hold NaN)",
                      _forward_case(poisoned, poison=True)))
    return cases


# ---------------------------------------------------------------------------------------------------
# Step 4: the tiled backward (fed the truth's o and lse, so it is judged on its own)
# ---------------------------------------------------------------------------------------------------
# float32 kernels: the dots in full float32, but exp2 and the order of the sums differ from the truth's; the
# package's kernel and the reader-style one of the tests stay within 4e-6 (times 1 + |truth|) on these cases
KERNEL_GRAD_ATOL = 5e-5


def _backward_case(s: Shape, seed=0, memory=False, kernel=False, poison=False):
    """One backward case; memory: the footprint must stay under the tiled budget (no (Tq, Tk) matrix, no
    product wider than a tile), as in the forward's tiling cases. kernel: the Triton step's case, in float32
    (q, k, v, dO rounded to float32 first, so the truth is exact for the inputs the kernel gets; o and lse
    the truth's, rounded to float32), judged within KERNEL_GRAD_ATOL. poison: NaN in k and v where no query
    may look, so that a skipped tile loaded anyway shows (its dK and dV are 0 in the truth)."""
    dtype, atol = (torch.float32, KERNEL_GRAD_ATOL) if kernel else (torch.float64, 1e-10)

    def run(impl):
        q, k, v = (randn(s.B, s.H, T, s.D, seed=seed + i).to(dtype) for i, T in enumerate((s.Tq, s.Tk, s.Tk)))
        do = randn(s.B, s.H, s.Tq, s.D, seed=seed + 3).to(dtype)
        o, lse, *grads = attention_grads_truth(q, k, v, do, s.causal, s.scale, s.alignment)
        if kernel:
            q, k, v, do, o, lse = (t.to(dtype).to(device()) for t in (q, k, v, do, o, lse))

        def call(k=k, v=v):
            return impl.flash_attention_backward(q, k, v, o, lse, do, causal=s.causal, scale=s.scale,
                                                 block_q=s.block_q, block_k=s.block_k, alignment=s.alignment)

        if poison:
            start = _hidden_key_tiles(s)
            k_in, v_in = k.clone(), v.clone()
            k_in[..., start:, :] = float("nan")
            v_in[..., start:, :] = float("nan")
            out = call(k_in, v_in)
        elif memory:
            out, footprint = measured(impl, call)
        else:
            out = call()
        if not (isinstance(out, tuple | list) and len(out) == 3):
            raise PracticeFailure(f"expected (dq, dk, dv), got {type(out).__name__}")

        def diagnose(got):
            def same(scale, alignment, causal=s.causal, mask=None):  # the backward's equations, another τ or mask
                alt = backward_equations(q, k, v, o, lse, do, causal, scale, alignment, mask)
                return all(matches(g, r, 10 * atol) for g, r in zip(got, alt))

            return backward_symptom(s, (q, k, v, o, lse, do), got, grads, same, 10 * atol)

        def symptom():
            if poison and any(isinstance(g, torch.Tensor) and torch.isnan(g).any() for g in out):
                clean = call()  # the same call without the NaN: is that the only bug?
                if all(matches(g, r, atol) for g, r in zip(clean, grads)):
                    nan = [isinstance(g, torch.Tensor) and bool(torch.isnan(g).any()) for g in out]
                    return skipped_tiles_hint(
                        ["where the query tile's loop over key tiles ends (dQ)"] * nan[0]
                        + ["where the key tile's loop over query tiles starts (dK, dV)"] * (nan[1] or nan[2]))
                return diagnose(clean)
            return diagnose(out)

        def check():
            for name, g, ref in zip(("dv", "dk", "dq"), out[::-1], grads[::-1]):
                if kernel:
                    check_dtype(name, g, dtype)
                compare(name, g, ref, atol)

        with_symptom(check, symptom)
        if memory:
            tile = max(s.block_q, s.block_k)
            budget = MEMORY_FACTOR * max(q.numel() * q.element_size(), k.numel() * k.element_size(), tile * tile * 8)
            if footprint.largest_tensor > budget:
                raise PracticeFailure(
                    f"a tensor of {footprint.largest_tensor / 2**10:.0f} KiB was created; the tiled backward needs "
                    f"none over {budget / 2**10:.0f} KiB ({MEMORY_FACTOR} x the larger of q, k and one score tile; "
                    f"the full P is {s.B * s.H * s.Tq * s.Tk * 8 / 2**10:.0f} KiB)", HINT_MEMORY_BACKWARD)
            rows, cols = footprint.widest_product
            if rows * cols > tile * max(tile, s.D):
                raise PracticeFailure(
                    f"a matrix product gave a ({rows}, {cols}) output; a tiled backward's products are one tile of "
                    f"S or dP ({s.block_q}, {s.block_k}), or one tile's share of dQ, dK or dV (block, D = {s.D}): "
                    "that is not FlashAttention's tiling", HINT_MEMORY_BACKWARD)
    return run


def backward_with_delta(q, k, v, o, lse, do, causal, scale, alignment, block_k, delta: str):
    """(dq, dk, dv) in float64 of a backward whose D is wrong: "tile" sums D = rowsum(P * dP) over the current
    key tile only, "none" leaves D out (dS = P * dP)."""
    q, k, v, o, lse, do = (t.detach().double().cpu() for t in (q, k, v, o, lse, do))
    tau = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    seen = visible(q.shape[2], k.shape[2], causal, alignment) & ~torch.isneginf(lse)[..., None]
    p = torch.where(seen, torch.exp(tau * q @ k.transpose(-1, -2) - torch.where(seen, lse[..., None], 0.0)), 0.0)
    dp = do @ v.transpose(-1, -2)
    if delta == "none":
        ds = p * dp
    else:
        ds = torch.cat([pt * (dpt - (pt * dpt).sum(-1, keepdim=True))
                        for pt, dpt in zip(p.split(block_k, -1), dp.split(block_k, -1))], -1)
    return tau * ds @ k, tau * ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ do


# --8<-- [start:p_units]
LOG2E, LN2 = math.log2(math.e), math.log(2.0)
UNIT_NAMES = {1.0: "1", LOG2E: "log2(e)", LN2: "ln 2"}


def backward_with_p_units(q, k, v, o, lse, do, causal, scale, alignment, a, b):
    """(dq, dk, dv) in float64 of a backward whose recomputed P is exp(a τ S - b lse):
    exp of log2 units (a = b = log2 e), exp2 of natural units (a = b = ln 2), or one
    term converted and the other not. dS = P (dP - D) and the factors τ as they
    should be."""
    q, k, v, o, lse, do = (t.detach().double().cpu() for t in (q, k, v, o, lse, do))
    tau = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    seen = visible(q.shape[2], k.shape[2], causal, alignment)
    seen = seen & ~torch.isneginf(lse)[..., None]
    lse_b = torch.where(seen, b * lse[..., None], 0.0)
    p = torch.where(seen, torch.exp(a * tau * q @ k.transpose(-1, -2) - lse_b), 0.0)
    ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    return tau * ds @ k, tau * ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ do


def p_units_hint(a: float, b: float) -> Hint:
    """The hint for P recomputed as exp(a τ S - b lse), (a, b) != (1, 1)."""
    formula = ("P = exp2(S · τ log2(e) - lse · log2(e)): both terms in log2 units; "
               "or exp(τ S - lse), both natural")
    if a == b == LOG2E:
        nudge = ("your gradients are those of P = exp(log2(e) (τ S - lse)): exp "
                 "applied to log2 units; look where P is recomputed (exp2 there, "
                 "or no log2(e))")
    elif a == b == LN2:
        nudge = ("your gradients are those of P = exp2(τ S - lse): exp2 of natural "
                 "units, log2(e) missing from qk_scale and from lse; look where P is "
                 "recomputed")
    else:
        nudge = (f"your gradients are those of P = exp({UNIT_NAMES[a]} · τ S - "
                 f"{UNIT_NAMES[b]} · lse): the scores and lse in different log units; "
                 "look at qk_scale and at the lse term where P is recomputed")
    return Hint("p_units", nudge, formula)
# --8<-- [end:p_units]


# --8<-- [start:one_gradient]
GRADIENT_LINES = {
    "dV": ("dQ and dK are right, so P and dS are, and dV is not: look at the line "
           "that accumulates dV (Pᵀ dO: Pᵀ, not P, times the query tile's dO)",
           "dV_j += P_ijᵀ dO_i; in the key tile's program pT = Pᵀ is "
           "(block_k, block_q) and dv += tl.dot(pT, do)"),
    "dK": ("dQ and dV are right, so P and dS are, and dK is not: look at the line "
           "that accumulates dK (τ dSᵀ Q)", "dK_j += τ dS_ijᵀ Q_i"),
    "dQ": ("dK and dV are right, so P and dS are, and dQ is not: look at the line "
           "that accumulates dQ (τ dS K) and at its loop over the key tiles",
           "dQ_i += τ dS_ij K_j over every key tile j that row i sees"),
}


HINT_DKDV_PROGRAM = Hint(
    "dkdv_program",
    "dQ is right, so P and dS are, and dK and dV are not: look at the key tile's "
    "program, at the query tiles its loop visits (where it starts under causal)",
    "query row i sees key j0 from i = j0 - offset on: start at the query tile "
    "max(j0 - offset, 0) // block_q")


def one_gradient_hint(wrong: list[str]) -> Hint | None:
    """The hint when one gradient is wrong (not by a constant factor), or dK and dV."""
    if wrong == ["dK", "dV"]:
        return HINT_DKDV_PROGRAM
    if len(wrong) != 1:
        return None
    return Hint(f"{wrong[0].lower()}_line", *GRADIENT_LINES[wrong[0]])
# --8<-- [end:one_gradient]


def backward_symptom(s, inputs, out, grads, same, atol=1e-9) -> Hint | None:
    """The hint wrong gradients point at, or None: a later batch wrong, a NaN where a row sees no key, the
    mask missing from the recomputed P, the other alignment, another temperature, P in mixed log units, a
    per-tile or missing D (each of these in one kernel or in both), one gradient off by a constant factor,
    one gradient wrong and the others right, or dK and dV wrong and dQ right. ``atol``: the tolerance of
    "equal" for the alternatives (float64 steps: 1e-9)."""
    q, k, v, o, lse, do = inputs
    shaped = all(isinstance(g, torch.Tensor) and g.shape == r.shape for g, r in zip(out, grads))
    if shaped and s.B >= 2 and all(matches(g[:1], r[:1], atol) for g, r in zip(out, grads)):
        return HINT_BATCH  # batch 0 right and a later one not (before NaN: a batch never written holds any bytes)
    if any(isinstance(g, torch.Tensor) and torch.isnan(g).any() for g in out):
        return HINT_NEG_INF_BACKWARD if torch.isneginf(lse).any() else None
    if not shaped:
        return None
    other = s.causal and s.Tq != s.Tk and same(s.scale, "lower_right" if s.alignment == "upper_left" else
                                               "upper_left")

    def explains(alt) -> bool:  # each gradient the alternative's or the truth's, one the alternative's only:
        right = [matches(g, r, atol) for g, r in zip(out, grads)]  # the mistake in one kernel or in both
        mine = [matches(g, r, atol) for g, r in zip(out, alt)]
        return all(a or b for a, b in zip(right, mine)) and any(b and not a for a, b in zip(right, mine))

    unmasked = False
    if s.causal:  # P unmasked: everywhere, or within the tiles a skipping loop visits
        seen = visible(s.Tq, s.Tk, True, s.alignment).double()
        tiles = torch.nn.functional.max_pool2d(seen[None], (s.block_q, s.block_k), ceil_mode=True)[0]
        in_tiles = tiles.repeat_interleave(s.block_q, 0).repeat_interleave(s.block_k, 1)[:s.Tq, :s.Tk] > 0
        unmasked = any(explains(backward_equations(q, k, v, o, lse, do, causal, s.scale, s.alignment, mask))
                       for causal, mask in [(False, None), (True, in_tiles)])
    if other and unmasked:  # on this case the two mistakes give the same gradients: say both
        return Hint("mask_backward+alignment", "your gradients are both the other alignment's and those of an "
                    "unmasked P (on this case the two coincide): look at the mask's offset and at the mask on the "
                    "recomputed P", f"{HINT_ALIGNMENT.formula}; {HINT_MASK_BACKWARD.formula}")
    if other:
        return HINT_ALIGNMENT
    if unmasked:
        return HINT_MASK_BACKWARD
    a = AttentionInputs(q, k, v, s.causal, s.scale, s.alignment, s.block_k, atol, torch.float64)
    for tau, hint in a.other_scales():
        if same(tau, s.alignment):
            return hint
    for units in [(LOG2E, LOG2E), (LN2, LN2), (1.0, LOG2E), (1.0, LN2), (LOG2E, 1.0), (LN2, 1.0)]:
        if explains(backward_with_p_units(q, k, v, o, lse, do, s.causal, s.scale, s.alignment, *units)):
            return p_units_hint(*units)
    for hint, delta in [(HINT_DELTA_TILE, "tile"), (HINT_DELTA_MISSING, "none")]:
        if explains(backward_with_delta(q, k, v, o, lse, do, s.causal, s.scale, s.alignment, s.block_k, delta)):
            return hint
    wrong = [(name, g.detach().double().cpu(), ref) for name, g, ref in zip(("dQ", "dK", "dV"), out, grads)
             if not matches(g, ref, atol)]
    if len(wrong) == 1:  # one gradient wrong: off by a constant factor, or its own line
        name, g64, ref = wrong[0]
        factor = float((g64 * ref).sum() / (ref * ref).sum()) if (ref * ref).sum() > 0 else 0.0
        if factor and not math.isclose(factor, 1.0) and matches(g64, factor * ref, atol):
            return factor_hint(name, factor, a.tau)
    return one_gradient_hint([name for name, _, _ in wrong])


def backward_cases() -> list[Case]:
    shapes = [
        (Shape(1, 2, 32, 32, 8, 16, 16, scale=0.3), "blocks divide T", True),
        (Shape(1, 2, 20, 37, 8, 16, 8), "Tq != Tk, ragged tiles", True),
        (Shape(1, 2, 37, 37, 8, 16, 16, True), "causal, ragged tiles", True),
        (Shape(2, 1, 20, 37, 8, 8, 16, True, "lower_right"), "causal, Tq < Tk", True),
        (Shape(1, 1, 37, 20, 8, 16, 8, True, "upper_left", 0.7), "causal, Tq > Tk", False),
        (Shape(1, 1, 40, 13, 8, 16, 16, True, "lower_right"), "rows that see no key get zero gradients", True),
    ]
    tiled = Shape(1, 1, 128, 128, 8, 16, 16, True, "lower_right", 0.5)
    return [Case(f"{s} ({why})", _backward_case(s), fast) for s, why, fast in shapes] + [
        Case(f"{tiled} (memory: the full P would be 128 KiB; tiled: no product wider than a tile)",
             _backward_case(tiled, memory=True))]


# ---------------------------------------------------------------------------------------------------
# Step 5: the fused softmax kernel (Triton)
# ---------------------------------------------------------------------------------------------------
def _softmax_case(rows, cols, block=None, dtype=torch.float32, neg_inf_prefix=0, span=None):
    def run(impl):
        x = randn(rows, cols) * 3
        if span is not None:  # every row rises from span[0] to span[1]
            x = torch.linspace(*span, cols, dtype=torch.float64).repeat(rows, 1) + x
        x = x.to(dtype)
        if neg_inf_prefix:
            x[:, :neg_inf_prefix] = float("-inf")
        y = impl.softmax(x.to(device()), block=block) if block else impl.softmax(x.to(device()))
        check_dtype("softmax(x)", y, dtype)

        def symptom():
            y64 = y.detach().double().cpu()
            if not torch.isfinite(y64).all():
                if x[torch.isfinite(x)].abs().max() > EXP_LIMIT[torch.float32]:
                    return HINT_MAX
                if torch.isnan(y64).any() and neg_inf_prefix:
                    return HINT_NEG_INF
            wrong_rows = wrong_entries(y64, softmax_truth(x), atol).any(-1)
            if block and rescale_symptom(wrong_rows, grows_after_first_block(x.double(), block)):
                return HINT_RESCALE
            return None

        atol = 1e-5 if dtype == torch.float32 else 2e-3
        with_symptom(lambda: compare("softmax(x)", y, softmax_truth(x), atol), symptom)
    return run


def fused_softmax_cases() -> list[Case]:
    return [
        Case("x (4, 16): the row fits one power-of-two block", _softmax_case(4, 16)),
        Case("x (3, 37): 37 columns, not a power of two", _softmax_case(3, 37)),
        Case("x (2, 100), block=32: the row streams in 4 blocks", _softmax_case(2, 100, block=32)),
        Case("x (2, 64): rows rising from -40 to 1000 (exp overflows float32 past 88)",
             _softmax_case(2, 64, span=(-40.0, 1000.0))),
        Case("x (2, 100), block=32, first 40 columns -inf", _softmax_case(2, 100, 32, neg_inf_prefix=40),
             fast=False),
        Case("x (3, 50) float16", _softmax_case(3, 50, dtype=torch.float16), fast=False),
    ]


# ---------------------------------------------------------------------------------------------------
# Step 6: the forward kernel (Triton); float32 and float16 only, never bfloat16 in the interpreter
# ---------------------------------------------------------------------------------------------------
def forward_kernel_cases() -> list[Case]:
    f32 = torch.float32
    lower_empty = Shape(1, 1, 40, 13, 16, 16, 16, True, "lower_right")
    upper_poison = Shape(1, 1, 20, 64, 16, 16, 16, True, "upper_left")
    views = Shape(2, 2, 37, 37, 16, 16, 16, True, scale=0.2)
    return [
        Case(f"{Shape(2, 2, 32, 32, 16, 16, 16, scale=0.5)} (blocks divide T, 2 batches)",
             _forward_case(Shape(2, 2, 32, 32, 16, 16, 16, scale=0.5), f32, kernel=True)),
        Case(f"{Shape(1, 2, 20, 37, 16, 16, 16)} (Tk = 37: 11 padded keys in the last tile)",
             _forward_case(Shape(1, 2, 20, 37, 16, 16, 16), f32, kernel=True)),
        Case(f"{Shape(1, 1, 37, 37, 16, 16, 16, True)} (ragged diagonal tile)",
             _forward_case(Shape(1, 1, 37, 37, 16, 16, 16, True), f32, kernel=True)),
        Case(f"{lower_empty} (the first 27 rows see no key)", _forward_case(lower_empty, f32, kernel=True)),
        Case(f"{upper_poison} (Tq < Tk: key tiles 2-3 are seen by no row and hold NaN)",
             _forward_case(upper_poison, f32, kernel=True, poison=True)),
        Case(f"{views}, q/k/v are transposed (B, T, H, D) views", _forward_case(views, f32, kernel=True,
                                                                                 transposed=True)),
        Case(f"{Shape(1, 1, 20, 20, 24, 16, 16)} (D = 24 is not a power of two)",
             _forward_case(Shape(1, 1, 20, 20, 24, 16, 16), f32, kernel=True), fast=False),
        Case(f"{Shape(1, 1, 64, 64, 16, 16, 16, True)} (Tq = Tk = 64, a multiple of the tiles)",
             _forward_case(Shape(1, 1, 64, 64, 16, 16, 16, True), f32, kernel=True)),
        Case(f"{Shape(1, 1, 32, 64, 16, 16, 16, True, 'lower_right')} (lengths a multiple of the tiles)",
             _forward_case(Shape(1, 1, 32, 64, 16, 16, 16, True, "lower_right"), f32, kernel=True)),
        Case(f"{Shape(1, 1, 16, 512, 16, 16, 16)}, float16 inputs (m and l in float32)",
             _forward_case(Shape(1, 1, 16, 512, 16, 16, 16), torch.float16, kernel=True)),
    ]


# ---------------------------------------------------------------------------------------------------
# Step 7: the backward kernels (Triton), in float32 (the interpreter's bfloat16 is wrong)
# ---------------------------------------------------------------------------------------------------
# --8<-- [start:backward_kernel_cases]
def backward_kernel_cases() -> list[Case]:
    shapes = [  # each (shape, what it exposes); D = 16, tiles of 16
        (Shape(2, 1, 32, 32, 16, 16, 16, scale=0.3),
         "2 batches: the batch axis, τ in dK and dQ, P's units"),
        (Shape(1, 2, 20, 37, 16, 16, 16), "Tq != Tk, ragged tiles, no mask"),
        (Shape(1, 1, 37, 37, 16, 16, 16, True), "causal, a ragged diagonal tile"),
        (Shape(1, 1, 20, 37, 16, 16, 16, True, "lower_right", 0.5),
         "causal, Tq < Tk: the diagonal ends bottom-right"),
        (Shape(1, 1, 37, 20, 16, 16, 16, True, "upper_left", 0.7),
         "causal, Tq > Tk: the diagonal starts top-left"),
        (Shape(1, 1, 40, 13, 16, 16, 16, True, "lower_right"),
         "the first 27 rows see no key: zero gradients, no NaN"),
    ]
    cases = [Case(f"{s} ({why})", _backward_case(s, kernel=True)) for s, why in shapes]
    poisoned = Shape(1, 1, 20, 64, 16, 16, 16, True, "upper_left")
    why = "Tq < Tk: key tiles 2-3 are seen by no row and hold NaN"
    poison = _backward_case(poisoned, kernel=True, poison=True)
    return cases + [Case(f"{poisoned} ({why})", poison)]
# --8<-- [end:backward_kernel_cases]


def _short_error(exc: BaseException) -> str:
    """The exception's type and message, and the last frame of the implementation's code."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "flashtile/practice/" not in f.filename.replace(
        "\\", "/")]
    where = f" (at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno})" if frames else ""
    message = str(exc).strip().splitlines()
    first = message[0] if message else ""
    if len(message) > 1:
        first += " ..." if len(first) > 200 else " " + " ".join(m.strip() for m in message[1:4])
    if isinstance(exc, SystemExit):
        first = f"your code tried to end the checker (exit status {exc.code!r}); the case fails"
    return f"{type(exc).__name__}: {first[:400]}{where}"


def diagnosis(exc: BaseException, reader: bool) -> Hint:
    """The hint of a failed case: the symptom rule's, else what differs (no guess); for an error raised by
    the implementation, the rule for its message, else the error is the diagnosis."""
    hint = getattr(exc, "hint", None)
    if isinstance(hint, Hint):
        return hint
    if isinstance(hint, str):
        return Hint("reader", hint)
    if isinstance(exc, PracticeFailure):
        return no_diagnosis(exc.differs or str(exc))
    message = exc.error if reader else str(exc)
    if "arange" in message and "power of 2" in message:
        return HINT_ARANGE
    return Hint("error", "your code raised this error: look at the line it names (shapes, dtypes and devices of "
                         "what it received are in the case's name)")


# --8<-- [start:run_step]
def run_step(
    step: Step,
    impl: ModuleType,
    fast: bool = False,
    stop_at_first_failure: bool = False,
    start: int = 0,
    on_start: Callable[[int, Case], None] | None = None,
    on_case: Callable[[int, Case, Failure | None], None] | None = None,
) -> StepResult:
    """Run the cases of ``step`` (from index ``start``) against ``impl``; never raises
    for a failing case, whatever the implementation raises (SystemExit included; only a
    KeyboardInterrupt stops the run). ``on_start(n, case)`` is called before each case,
    ``on_case(n, case, failure or None)`` after it."""
    result = StepResult(step)
    cases = [c for c in step.cases() if c.fast or not fast]
    for n, case in enumerate(cases[start:], start):
        if on_start:
            on_start(n, case)
        missing = [f for f in step.functions if not callable(getattr(impl, f, None))]
        try:
            if missing:
                raise PracticeFailure(f"the module defines no {', '.join(missing)}")
            # numpy's warnings from the Triton interpreter, on NaN it then discards
            with warnings.catch_warnings():
                warnings.filterwarnings(
                    "ignore", category=RuntimeWarning, module=r"triton\."
                )
                case.run(impl)
        except KeyboardInterrupt:
            raise
        # the implementation's own error (or exit) fails this case, not the run
        except BaseException as exc:
            # raised in the worker process, formatted there
            reader = isinstance(exc, ReaderError)
            # an untouched skeleton: the rest fail the same way
            unwritten = (
                exc.unwritten if reader else isinstance(exc, NotImplementedError)
            )
            exited = exc.exited if reader else isinstance(exc, SystemExit)
            hint = (
                Hint("write", f"write {', '.join(step.functions)} in {step.file}.py")
                if unwritten
                else (HINT_EXIT if exited else diagnosis(exc, reader))
            )
            result.failures.append(
                Failure(
                    case.name,
                    exc.error if reader else _short_error(exc),
                    hint,
                    step.chapter,
                )
            )
            if on_case:
                on_case(n, case, result.failures[-1])
            if unwritten or stop_at_first_failure:
                result.skipped = len(cases) - n - 1
                break
            continue
        result.passed += 1
        if on_case:
            on_case(n, case, None)
    return result
# --8<-- [end:run_step]
