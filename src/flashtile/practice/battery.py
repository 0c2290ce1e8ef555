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

# Hints for the classic mistakes; a case may also raise PracticeFailure with its own.
HINT_RESCALE = ("when the running max grows, rescale what you kept: l = exp(m - m_new) * l + sum(exp(x - m_new)), "
                "and the same factor on acc")
HINT_NEG_INF = ("guard exp(-inf - (-inf)) = NaN: a row that has seen no finite score yet has m = -inf; "
                "subtract 0 instead (alpha = p = 0), and give a row that sees no key o = 0, lse = -inf")
HINT_MAX = ("subtract the running max before exp: exp(x) overflows past x = 88 in float32 and 709 in float64, "
            "while exp(x - m) <= 1 never does")
HINT_SKIP = ("causal tile count: the last query row q_end - 1 sees keys up to q_end - 1 + offset, so the tile "
             "needs key tiles 0 .. (q_end - 1 + offset) // block_k (floor division, then + 1)")
HINT_SKIPPED_TILE_READ = ("a key tile that no row of the query tile can see (k_start > q_end - 1 + offset) must not "
                          "be loaded at all: this case fills k and v there with NaN, and your output has NaN")
HINT_ALIGNMENT = ("alignment: query i sees key j iff j <= i + offset, offset = 0 for 'upper_left' and Tk - Tq for "
                  "'lower_right'; your output is the other alignment's")
HINT_SCALE = ("multiply the scores by the scale τ you are given, once (1/sqrt(D) only when scale is None); "
              "your output is attention at another scale")
HINT_UNITS = ("lse is a natural log: with exp2 and scores times τ·log2(e), the statistics are in log2 units, so "
              "lse = (m + log2 l) · ln 2; your lse is off by a factor log2(e) or ln 2")
HINT_MASK_BACKWARD = ("apply the causal mask when you recompute P = exp(S - lse) in the backward too: "
                      "a hidden key would get P > 0 there, though the forward gave it 0")
HINT_LSE = ("keep m, l and lse in float32 (float64 for float64 inputs): statistics rounded to 16 bits are off by "
            "up to 2^-8 relative, and the backward's exp(S - lse) carries that error into every P")
HINT_PADDED = ("padded keys (columns j >= Tk of the last tile) must score -inf, not 0: "
               "s = tl.where(j[None, :] < Tk, s, float('-inf'))")
HINT_STRIDES = ("use the tensors' own strides (q.stride(), k.stride(), ...) for pointer arithmetic: "
                "a transposed (B, T, H, D) view is not laid out like a contiguous (B, H, T, D) tensor")
HINT_BATCH = ("batch: batch 0 is right and a later batch is not. Give every (query tile, head, batch) its own "
              "program (a grid axis for b) and offset the pointers by b * stride_b + h * stride_h, not by "
              "(b * H + h) * stride_h, which only holds for a contiguous (B, H, T, D) tensor")
HINT_MEMORY = ("tile: keep only (m, l, acc) per query tile and one (block_q, block_k) tile of scores; the whole "
               "Tq x Tk score matrix, or a block_q x Tk strip of it, is what FlashAttention never forms")
HINT_MEMORY_BACKWARD = ("tile the backward too: recompute P one (block_q, block_k) tile at a time from q, k and lse, "
                        "and use D = rowsum(dO * O) for dS; autograd through a full softmax forms the whole Tq x Tk "
                        "matrix P (and dP), which is what the tiled backward never does")
HINT_ARANGE = ("tl.arange needs a power-of-two length: BLOCK = triton.next_power_of_2(n_cols), "
               "and mask the extra lanes (load them as -inf)")
HINT_DELTA = "dS = P * (dP - D) with D = rowsum(dO * O)"
HINT_EXIT = "return the results instead of ending the process: sys.exit and raise SystemExit only fail the case"

EXP_LIMIT = {torch.float64: 709.78, torch.float32: 88.72}  # exp overflows past these


class PracticeFailure(AssertionError):
    """A case's check failed; ``hint`` names the idea most likely missing."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


class ReaderError(Exception):
    """What the reader's code did in the worker process, as the checker saw it: the error it raised (already
    formatted, with the reader's file and line), a time limit passed, or the process ended."""

    def __init__(self, error: str, hint: str | None = None, unwritten: bool = False, exited: bool = False):
        super().__init__(error)
        self.error, self.hint, self.unwritten, self.exited = error, hint, unwritten, exited


class Sandboxed:
    """A module whose functions run in another process; ``measured`` asks that process for the footprint."""

    def measured(self, thunk: Callable[[], object]):
        raise NotImplementedError


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
    hint: str
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
    hint: str
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


def compare(name: str, actual, expected, atol: float, hint: str | None = None) -> None:
    """actual equals expected (float64) within atol + atol * |expected|, with the same -inf entries."""
    if not isinstance(actual, torch.Tensor):
        raise PracticeFailure(f"{name}: expected a tensor, got {type(actual).__name__}")
    if tuple(actual.shape) != tuple(expected.shape):
        raise PracticeFailure(f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if torch.isnan(a).any() and not torch.isnan(e).any():
        first = torch.isnan(a).nonzero()[0].tolist()
        raise PracticeFailure(f"{name}: {int(torch.isnan(a).sum())} NaN entries (first at {first}), the truth has none",
                              hint)
    if not torch.equal(torch.isneginf(a), torch.isneginf(e)):
        where = (torch.isneginf(a) != torch.isneginf(e)).nonzero()[0].tolist()
        raise PracticeFailure(f"{name}: -inf pattern differs at {where}: got {a[tuple(where)].item()}, "
                              f"expected {e[tuple(where)].item()}", hint)
    finite = torch.isfinite(e)
    err = (a[finite] - e[finite]).abs()
    bound = atol + atol * e[finite].abs()
    if (err > bound).any() or err.isnan().any():
        worst = int(torch.where(err.isnan(), torch.inf, err - bound).argmax())
        where = finite.nonzero()[worst].tolist()
        raise PracticeFailure(f"{name}: max abs error {err.max().item():.3g} > tolerance {atol:g} "
                              f"(worst at {where}: got {a[tuple(where)].item():.6g}, "
                              f"expected {e[tuple(where)].item():.6g})", hint)


def check_dtype(name: str, t, dtype, hint: str | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise PracticeFailure(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise PracticeFailure(f"{name} has dtype {t.dtype}, expected {dtype}", hint)


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
    """Wrong exactly where it matters: some rows wrong, every wrong row's max grew after its first block,
    and some rows whose max did not grow are right (so the evidence is not just 'everything is wrong')."""
    return bool(wrong_rows.any() and not (wrong_rows & ~growing_rows).any() and (~growing_rows).any())


@dataclass
class AttentionInputs:
    """What a forward case passed, and what its truth needs to test the symptoms' hypotheses."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool
    scale: float | None
    alignment: str
    block_k: int
    atol: float
    compute: torch.dtype  # the dtype the statistics should be computed in

    def truth(self, **change):
        a = replace(self, **change)
        return attention_truth(a.q, a.k, a.v, a.causal, a.scale, a.alignment)

    def scores(self) -> torch.Tensor:
        """The float64 scores τ q kᵀ with hidden keys at -inf."""
        q, k = self.q.double().cpu(), self.k.double().cpu()
        tau = 1.0 / math.sqrt(q.shape[-1]) if self.scale is None else self.scale
        s = tau * q @ k.transpose(-1, -2)
        return s.masked_fill(~visible(q.shape[-2], k.shape[-2], self.causal, self.alignment), float("-inf"))

    def other_scales(self) -> list[float | None]:
        d = 1.0 / math.sqrt(self.q.shape[-1])
        tau = d if self.scale is None else self.scale
        return [t for t in (d, 1.0, tau * tau, tau * d) if not math.isclose(t, tau)]


def attention_symptom(a: AttentionInputs, o, lse) -> str | None:
    """The hint a wrong (o, lse) points at, or None when no rule fits (the case's own hint is used)."""
    o_ref, lse_ref = a.truth()
    if not (isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor)
            and o.shape == o_ref.shape and lse.shape == lse_ref.shape):
        return None
    o64, lse64 = o.detach().double().cpu(), lse.detach().double().cpu()
    wrong_rows = wrong_entries(o64, o_ref, a.atol).any(-1) | wrong_entries(lse64, lse_ref, a.atol)
    if o64.shape[0] >= 2 and not wrong_rows[0].any():  # before NaN: a batch never written may hold any bytes
        return HINT_BATCH
    nan_rows = torch.isnan(o64).any(-1) | torch.isnan(lse64)
    overflow = a.scores().max().item() > EXP_LIMIT.get(a.compute, EXP_LIMIT[torch.float32])
    if nan_rows.any():  # NaN: the rows that see no key (a missing guard), or exp overflowing (no max)
        empty = torch.isneginf(lse_ref)
        if not (nan_rows & ~empty).any():
            return HINT_NEG_INF
        return HINT_MAX if overflow else None
    if overflow and not torch.isfinite(o64).all():
        return HINT_MAX
    finite = torch.isfinite(lse_ref)
    for factor in (math.log2(math.e), math.log(2.0)):  # log2 units, or converted twice
        if matches(lse64[finite], lse_ref[finite] * factor, a.atol):
            return HINT_UNITS
    def explains(alternative):  # o is the alternative's, and the alternative is not the truth's
        return matches(o64, alternative, a.atol) and not matches(o_ref, alternative, a.atol)

    if a.causal and a.q.shape[-2] != a.k.shape[-2]:
        if explains(a.truth(alignment="lower_right" if a.alignment == "upper_left" else "upper_left")[0]):
            return HINT_ALIGNMENT
    if any(explains(a.truth(scale=tau)[0]) for tau in a.other_scales()):
        return HINT_SCALE
    if not a.q.is_contiguous():  # the same memory read as if it were a contiguous (B, H, T, D) tensor
        raw = [torch.as_strided(t, t.shape, torch.empty(t.shape).stride(), t.storage_offset())
               for t in (a.q, a.k, a.v)]
        if matches(o64, a.truth(q=raw[0], k=raw[1], v=raw[2])[0], a.atol):
            return HINT_STRIDES
    Tk = a.k.shape[-2]
    if not a.causal and Tk % a.block_k:  # padded keys loaded as 0 and never hidden: they score 0
        pad = a.block_k - Tk % a.block_k
        k0, v0 = (torch.cat([t.double().cpu(), t.new_zeros((*t.shape[:-2], pad, t.shape[-1])).double().cpu()], -2)
                  for t in (a.k, a.v))
        if matches(o64, a.truth(k=k0, v=v0)[0], a.atol):
            return HINT_PADDED
    def rounding_size(got, ref):  # within 2^-7 relative: what a 16-bit rounding does, not a missing idea
        return bool(((got - ref).abs() <= 2**-7 * (ref.abs() + 1)).all())

    if rounding_size(o64, o_ref) and rounding_size(lse64[finite], lse_ref[finite]):
        return HINT_LSE
    if rescale_symptom(wrong_rows, grows_after_first_block(a.scores(), a.block_k)):
        return HINT_RESCALE
    return None
# --8<-- [end:symptom]


def with_symptom(check: Callable[[], None], symptom: Callable[[], str | None]) -> None:
    """Run ``check``; if it fails, let the symptom choose the hint (the case's stays when none fits)."""
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
def _stats_symptom(x: torch.Tensor, block: int, lse) -> str | None:
    truth = logsumexp_truth(x)
    if not isinstance(lse, torch.Tensor) or lse.shape != truth.shape:
        return None
    got = lse.detach().double().cpu()
    finite = torch.isfinite(x)
    if (~torch.isfinite(got) & torch.isfinite(truth)).any():
        if x[finite].abs().max() > EXP_LIMIT[torch.float64] and not torch.isnan(got).any():
            return HINT_MAX
        empty_first = torch.isneginf(x[..., :block]).all(-1)
        if torch.isnan(got).any() and (torch.isnan(got) <= (empty_first | torch.isneginf(truth))).all():
            return HINT_NEG_INF
        if x[finite].abs().max() > EXP_LIMIT[torch.float64]:
            return HINT_MAX
    if rescale_symptom(wrong_entries(got, truth, 1e-12), grows_after_first_block(x, block)):
        return HINT_RESCALE
    return None


def _stats_case(x: torch.Tensor, block: int):
    def run(impl):
        m, l = impl.online_softmax_stats(x, block)
        compare("m", m, x.amax(dim=-1), 0.0)
        lse = impl.lse_from_stats(m, l)
        with_symptom(lambda: compare("lse_from_stats(m, l)", lse, logsumexp_truth(x), 1e-12),
                     lambda: _stats_symptom(x, block, lse))
    return run


def _merge_case(x: torch.Tensor, cut: int, block: int):
    def run(impl):
        m_a, l_a = impl.online_softmax_stats(x[..., :cut], block)
        m_b, l_b = impl.online_softmax_stats(x[..., cut:], block)
        m, l = impl.merge(m_a, l_a, m_b, l_b)
        compare("lse of merge(left, right)", impl.lse_from_stats(m, l), logsumexp_truth(x), 1e-12)
        empty_m = torch.full_like(m_a, float("-inf"))
        m, l = impl.merge(empty_m, torch.zeros_like(l_a), m_a, l_a)
        compare("lse of merge(empty state, left)", impl.lse_from_stats(m, l), logsumexp_truth(x[..., :cut]), 1e-12,
                HINT_NEG_INF)
    return run


def _merge_empty_case(rows: int):
    """merge(empty, empty) is the empty state: m = -inf, l = 0 (exp(-inf - (-inf)) would make l NaN)."""
    def run(impl):
        empty = torch.full((rows,), float("-inf"), dtype=torch.float64)
        m, l = impl.merge(empty, torch.zeros(rows, dtype=torch.float64), empty.clone(),
                          torch.zeros(rows, dtype=torch.float64))
        compare("m of merge(empty, empty)", m, empty, 0.0, HINT_NEG_INF)
        compare("l of merge(empty, empty)", l, torch.zeros(rows, dtype=torch.float64), 0.0, HINT_NEG_INF)
        compare("lse of merge(empty, empty)", impl.lse_from_stats(m, l), empty, 0.0, HINT_NEG_INF)
    return run


def _update_case(x: torch.Tensor):
    def run(impl):
        m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype)
        m, l = impl.online_softmax_update(m, torch.zeros_like(m), x)
        compare("lse after one update from the empty state", impl.lse_from_stats(m, l), logsumexp_truth(x), 1e-12,
                HINT_NEG_INF)
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
        wrong = lambda: wrong_entries(got, logsumexp_truth(full), 1e-12)  # noqa: E731
        with_symptom(lambda: compare("m + log(l) after the update", got, logsumexp_truth(full), 1e-12),
                     lambda: HINT_RESCALE if rescale_symptom(wrong(), x.amax(-1) > m0) else None)
    return run


# --8<-- [start:cases]
def online_softmax_cases() -> list[Case]:
    rising = torch.linspace(-40.0, 1000.0, 37, dtype=torch.float64)  # a new max in every block
    wide = torch.stack([rising, rising.flip(0), rising - 500.0])  # row 1's max is in its first block
    rows = randn(4, 37) * 5
    masked_prefix = rows.clone()
    masked_prefix[:, :9] = float("-inf")  # the first blocks hold nothing but -inf
    all_masked = torch.full((2, 10), float("-inf"), dtype=torch.float64)
    seen, new = rows[:, :8], rows[:, 8:14] + torch.tensor([[9.0], [9.0], [-9.0], [-9.0]], dtype=torch.float64)
    return [
        Case("update from the empty state, one block of 8 columns", _update_case(rows[:, :8]), HINT_NEG_INF),
        Case("stats, rows of 37 columns between -40 and 1000 in blocks of 8 (exp(1000) overflows float64)",
             _stats_case(wide, 8), HINT_RESCALE),
        Case("update from a state of 8 columns with 6 more: rows 0-1 get a new max, rows 2-3 do not",
             _update_from_state_case(seen, new), HINT_RESCALE),
        Case("stats, random rows of 37 columns in blocks of 5", _stats_case(rows, 5), HINT_RESCALE),
        Case("stats, block of 1 column", _stats_case(rows, 1), HINT_RESCALE, fast=False),
        Case("stats, block wider than the row (64 > 37)", _stats_case(rows, 64), HINT_RESCALE, fast=False),
        Case("stats, first 9 columns -inf, blocks of 4", _stats_case(masked_prefix, 4), HINT_NEG_INF),
        Case("stats, 2 rows of 10 columns all -inf (lse must be -inf)", _stats_case(all_masked, 4), HINT_NEG_INF),
        Case("merge two halves cut at column 13", _merge_case(rows, 13, 4), HINT_RESCALE),
        Case("merge two empty states of 3 rows (m = -inf, l = 0: nothing seen on either side)", _merge_empty_case(3),
             HINT_NEG_INF),
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
                            torch.float32 if low else torch.float64)
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
        check_dtype("lse", lse, torch.float32 if low else torch.float64, HINT_LSE)

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
        Case(f"{Shape(1, 2, 32, 32, 8, 16, 16)} (blocks divide T)", _forward_case(Shape(1, 2, 32, 32, 8, 16, 16)),
             HINT_RESCALE),
        Case(f"{Shape(1, 2, 20, 37, 8, 16, 16)} (Tq != Tk, blocks do not divide them)",
             _forward_case(Shape(1, 2, 20, 37, 8, 16, 16)), HINT_RESCALE),
        Case(f"{Shape(2, 1, 9, 33, 4, 4, 8)} (block_q != block_k)", _forward_case(Shape(2, 1, 9, 33, 4, 4, 8)),
             HINT_RESCALE, fast=False),
        Case(f"{Shape(1, 2, 16, 24, 8, 8, 8, scale=60.0)} (scores reach ±900: exp overflows even float64)",
             _forward_case(Shape(1, 2, 16, 24, 8, 8, 8, scale=60.0), gain=1.5), HINT_SCALE),
        Case(f"{Shape(1, 1, 24, 200, 16, 8, 8)}, float16 inputs (m, l and lse in float32)",
             _forward_case(Shape(1, 1, 24, 200, 16, 8, 8), dtype=torch.float16), HINT_LSE),
        Case(f"{big} (memory: the full score matrix would be 2 MiB)", _forward_case(big, memory=True), HINT_MEMORY),
        Case(f"{Shape(1, 2, 64, 64, 8, 16, 16)} (T a multiple of every tile; tiled: no product wider than a tile)",
             _forward_case(Shape(1, 2, 64, 64, 8, 16, 16), memory=True), HINT_MEMORY),
    ]


def causal_cases() -> list[Case]:
    shapes = [
        (Shape(1, 2, 32, 32, 8, 16, 16, True), "blocks divide T", True, HINT_SKIP),
        (Shape(1, 2, 37, 37, 8, 16, 16, True), "ragged last tiles", True, HINT_SKIP),
        (Shape(1, 2, 37, 37, 8, 8, 16, True), "block_q < block_k", False, HINT_SKIP),
        (Shape(1, 2, 20, 37, 8, 16, 8, True, "lower_right", 0.5), "Tq < Tk: the diagonal ends bottom-right", True,
         HINT_ALIGNMENT),
        (Shape(1, 2, 40, 13, 8, 16, 16, True, "lower_right"), "the first 27 rows see no key", True, HINT_NEG_INF),
    ]
    cases = [Case(f"{s} ({why})", _forward_case(s), hint, fast) for s, why, fast, hint in shapes]
    # lengths that are multiples of every tile size in use (16, 32, 64, 128), each alignment, measured for tiling
    for s, why in [(Shape(1, 2, 64, 64, 8, 16, 16, True), "Tq = Tk = 64"),
                   (Shape(1, 1, 128, 128, 8, 32, 32, True, "lower_right"), "Tq = Tk = 128"),
                   (Shape(1, 1, 64, 128, 8, 16, 32, True, "lower_right"), "Tq = 64 < Tk = 128"),
                   (Shape(1, 1, 128, 64, 8, 32, 16, True, "upper_left"), "Tq = 128 > Tk = 64")]:
        cases.append(Case(f"{s} ({why}: lengths a multiple of the tiles; tiled)", _forward_case(s, memory=True),
                          HINT_SKIP))
    poisoned = Shape(1, 1, 20, 64, 8, 16, 16, True, "upper_left")
    cases.append(Case(f"{poisoned} (Tq < Tk: key tiles 2-3 are seen by no row and hold NaN)",
                      _forward_case(poisoned, poison=True), HINT_SKIPPED_TILE_READ))
    return cases


# ---------------------------------------------------------------------------------------------------
# Step 4: the tiled backward (fed the truth's o and lse, so it is judged on its own)
# ---------------------------------------------------------------------------------------------------
def _backward_case(s: Shape, seed=0, memory=False):
    """One backward case; memory: the footprint must stay under the tiled budget (no (Tq, Tk) matrix, no
    product wider than a tile), as in the forward's tiling cases."""
    def run(impl):
        q, k, v = (randn(s.B, s.H, T, s.D, seed=seed + i) for i, T in enumerate((s.Tq, s.Tk, s.Tk)))
        do = randn(s.B, s.H, s.Tq, s.D, seed=seed + 3)
        o, lse, *grads = attention_grads_truth(q, k, v, do, s.causal, s.scale, s.alignment)

        def call():
            return impl.flash_attention_backward(q, k, v, o, lse, do, causal=s.causal, scale=s.scale,
                                                 block_q=s.block_q, block_k=s.block_k, alignment=s.alignment)

        if memory:
            out, footprint = measured(impl, call)
        else:
            out = call()
        if not (isinstance(out, tuple | list) and len(out) == 3):
            raise PracticeFailure(f"expected (dq, dk, dv), got {type(out).__name__}")

        def same(scale, alignment):  # the backward's equations at another τ or mask, from the same o and lse
            alt = backward_equations(q, k, v, o, lse, do, s.causal, scale, alignment)
            return all(matches(g, r, 1e-9) for g, r in zip(out, alt))

        def symptom():
            if any(isinstance(g, torch.Tensor) and torch.isnan(g).any() for g in out):
                empty = torch.isneginf(lse)
                return HINT_NEG_INF if empty.any() else None
            if s.causal and s.Tq != s.Tk:
                if same(s.scale, "lower_right" if s.alignment == "upper_left" else "upper_left"):
                    return HINT_ALIGNMENT
            a = AttentionInputs(q, k, v, s.causal, s.scale, s.alignment, s.block_k, 1e-10, torch.float64)
            if any(same(tau, s.alignment) for tau in a.other_scales()):
                return HINT_SCALE
            return None

        def check():
            for name, g, ref in zip(("dv", "dk", "dq"), out[::-1], grads[::-1]):
                compare(name, g, ref, 1e-10)

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
    return [Case(f"{s} ({why})", _backward_case(s), HINT_MASK_BACKWARD if s.causal else HINT_DELTA, fast)
            for s, why, fast in shapes] + [
        Case(f"{tiled} (memory: the full P would be 128 KiB; tiled: no product wider than a tile)",
             _backward_case(tiled, memory=True), HINT_MEMORY_BACKWARD)]


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
            return None

        with_symptom(lambda: compare("softmax(x)", y, softmax_truth(x), 1e-5 if dtype == torch.float32 else 2e-3),
                     symptom)
    return run


def fused_softmax_cases() -> list[Case]:
    return [
        Case("x (4, 16): the row fits one power-of-two block", _softmax_case(4, 16), "one program per row"),
        Case("x (3, 37): 37 columns, not a power of two", _softmax_case(3, 37), HINT_ARANGE),
        Case("x (2, 100), block=32: the row streams in 4 blocks", _softmax_case(2, 100, block=32), HINT_RESCALE),
        Case("x (2, 64): rows rising from -40 to 1000 (exp overflows float32 past 88)",
             _softmax_case(2, 64, span=(-40.0, 1000.0)), HINT_MAX),
        Case("x (2, 100), block=32, first 40 columns -inf", _softmax_case(2, 100, 32, neg_inf_prefix=40),
             HINT_NEG_INF, fast=False),
        Case("x (3, 50) float16", _softmax_case(3, 50, dtype=torch.float16), "compute m and l in float32",
             fast=False),
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
             _forward_case(Shape(2, 2, 32, 32, 16, 16, 16, scale=0.5), f32, kernel=True), HINT_RESCALE),
        Case(f"{Shape(1, 2, 20, 37, 16, 16, 16)} (Tk = 37: 11 padded keys in the last tile)",
             _forward_case(Shape(1, 2, 20, 37, 16, 16, 16), f32, kernel=True), HINT_PADDED),
        Case(f"{Shape(1, 1, 37, 37, 16, 16, 16, True)} (ragged diagonal tile)",
             _forward_case(Shape(1, 1, 37, 37, 16, 16, 16, True), f32, kernel=True), HINT_SKIP),
        Case(f"{lower_empty} (the first 27 rows see no key)", _forward_case(lower_empty, f32, kernel=True),
             HINT_NEG_INF),
        Case(f"{upper_poison} (Tq < Tk: key tiles 2-3 are seen by no row and hold NaN)",
             _forward_case(upper_poison, f32, kernel=True, poison=True), HINT_SKIPPED_TILE_READ),
        Case(f"{views}, q/k/v are transposed (B, T, H, D) views", _forward_case(views, f32, kernel=True,
                                                                                 transposed=True), HINT_STRIDES),
        Case(f"{Shape(1, 1, 20, 20, 24, 16, 16)} (D = 24 is not a power of two)",
             _forward_case(Shape(1, 1, 20, 20, 24, 16, 16), f32, kernel=True),
             "pad the head dim to a power of two and mask it", fast=False),
        Case(f"{Shape(1, 1, 64, 64, 16, 16, 16, True)} (Tq = Tk = 64, a multiple of the tiles)",
             _forward_case(Shape(1, 1, 64, 64, 16, 16, 16, True), f32, kernel=True), HINT_SKIP),
        Case(f"{Shape(1, 1, 32, 64, 16, 16, 16, True, 'lower_right')} (lengths a multiple of the tiles)",
             _forward_case(Shape(1, 1, 32, 64, 16, 16, 16, True, "lower_right"), f32, kernel=True), HINT_ALIGNMENT),
        Case(f"{Shape(1, 1, 16, 512, 16, 16, 16)}, float16 inputs (m and l in float32)",
             _forward_case(Shape(1, 1, 16, 512, 16, 16, 16), torch.float16, kernel=True), HINT_LSE),
    ]


# --8<-- [start:steps]
STEPS: tuple[Step, ...] = (
    Step("online_softmax", "online_softmax", "flashtile.reference.online_softmax",
         ("online_softmax_update", "online_softmax_stats", "lse_from_stats", "merge"),
         "part-a/online-softmax/#the-derivation", "streaming (m, l), lse, merge", online_softmax_cases),
    Step("forward", "forward", "flashtile.reference.forward", ("flash_attention_forward",),
         "part-a/forward/#the-derivation", "tiled forward with (m, l, acc)", forward_cases),
    Step("causal", "forward", "flashtile.reference.forward", ("flash_attention_forward",),
         "part-a/causal-tiles/#the-derivation", "causal mask, both alignments, tile skipping", causal_cases),
    Step("backward", "backward", "flashtile.reference.backward", ("flash_attention_backward",),
         "part-a/backward/#the-derivation", "recomputed P, D = rowsum(dO * O)", backward_cases),
    Step("fused_softmax", "fused_softmax", "flashtile.kernels.softmax", ("softmax",),
         "part-b/fused-softmax/#the-derivation", "Triton row softmax", fused_softmax_cases, triton=True),
    Step("forward_kernel", "forward_kernel", "flashtile.kernels.forward", ("flash_attention",),
         "part-b/forward-kernel/#the-derivation", "Triton forward kernel and launcher", forward_kernel_cases,
         triton=True),
)
# --8<-- [end:steps]

STEP_NAMES = tuple(s.name for s in STEPS)


def step_named(name: str) -> Step:
    for step in STEPS:
        if step.name == name:
            return step
    raise KeyError(f"no step {name!r}; the steps are {', '.join(STEP_NAMES)}")


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


# --8<-- [start:run_step]
def run_step(step: Step, impl: ModuleType, fast: bool = False, stop_at_first_failure: bool = False,
             start: int = 0, on_start: Callable[[int, Case], None] | None = None,
             on_case: Callable[[int, Case, Failure | None], None] | None = None) -> StepResult:
    """Run the cases of ``step`` (from index ``start``) against ``impl``; never raises for a failing case,
    whatever the implementation raises (SystemExit included; only a KeyboardInterrupt stops the run).
    ``on_start(n, case)`` is called before each case, ``on_case(n, case, failure or None)`` after it."""
    result = StepResult(step)
    cases = [c for c in step.cases() if c.fast or not fast]
    for n, case in enumerate(cases[start:], start):
        if on_start:
            on_start(n, case)
        missing = [f for f in step.functions if not callable(getattr(impl, f, None))]
        try:
            if missing:
                raise PracticeFailure(f"the module defines no {', '.join(missing)}")
            with warnings.catch_warnings():  # numpy's warnings from the Triton interpreter, on NaN it then discards
                warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.")
                case.run(impl)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # the implementation's own error (or exit) fails this case, not the run
            reader = isinstance(exc, ReaderError)  # raised in the worker process, formatted there
            # an untouched skeleton: the rest fail the same way
            unwritten = exc.unwritten if reader else isinstance(exc, NotImplementedError)
            exited = exc.exited if reader else isinstance(exc, SystemExit)
            hint = f"write {', '.join(step.functions)} in {step.file}.py" if unwritten else HINT_EXIT if exited else (
                getattr(exc, "hint", None) or case.hint)
            result.failures.append(Failure(case.name, exc.error if reader else _short_error(exc), hint, step.chapter))
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
