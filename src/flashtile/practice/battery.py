"""The practice battery: every step's cases, written once, run against any implementation.

An implementation is a plain Python module (the package's own, or a file the reader wrote after
``python -m flashtile.practice init``). Each step names the functions it calls on that module, and
its cases build inputs, call them and compare with the float64 truth of ``flashtile.practice.truth``.
Nothing here imports the rest of flashtile: the battery judges the package's code, it must not borrow
from it.

A case that fails raises ``PracticeFailure`` (or whatever the implementation raised); the runner
records which case it was, the error, and a hint that names the idea most likely missing.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

import torch

from .truth import attention_grads_truth, attention_truth, logsumexp_truth, softmax_truth

SITE = "https://flashtile.github.io/flashtile/"

# Hints for the classic mistakes; a case may also raise PracticeFailure with its own.
HINT_RESCALE = ("when the running max grows, rescale what you kept: l = exp(m - m_new) * l + sum(exp(x - m_new)), "
                "and the same factor on acc")
HINT_NEG_INF = ("guard exp(-inf - (-inf)) = NaN: a row that has seen no finite score yet has m = -inf; "
                "subtract 0 instead (alpha = p = 0), and give a row that sees no key o = 0, lse = -inf")
HINT_SKIP = ("causal tile count: the last query row q_end - 1 sees keys up to q_end - 1 + offset, so the tile "
             "needs key tiles 0 .. (q_end - 1 + offset) // block_k (floor division, then + 1)")
HINT_MASK_BACKWARD = ("apply the causal mask when you recompute P = exp(S - lse) in the backward too: "
                      "a hidden key would get P > 0 there, though the forward gave it 0")
HINT_LSE = ("keep m, l and lse in float32 (float64 for float64 inputs): an lse rounded to 16 bits is off by up to "
            "2^-8 relative, and the backward's exp(S - lse) carries that error into every P")
HINT_PADDED = ("padded keys (columns j >= Tk of the last tile) must score -inf, not 0: "
               "s = tl.where(j[None, :] < Tk, s, float('-inf'))")
HINT_STRIDES = ("use the tensors' own strides (q.stride(), k.stride(), ...) for pointer arithmetic: "
                "a transposed (B, T, H, D) view is not laid out like a contiguous (B, H, T, D) tensor")
HINT_ARANGE = ("tl.arange needs a power-of-two length: BLOCK = triton.next_power_of_2(n_cols), "
               "and mask the extra lanes (load them as -inf)")
HINT_SCALE = "multiply the scores by the scale τ, 1/sqrt(D) when scale is None"


class PracticeFailure(AssertionError):
    """A case's check failed; ``hint`` names the idea most likely missing."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


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
    if (err > bound).any():
        worst = int((err - bound).argmax())
        where = finite.nonzero()[worst].tolist()
        raise PracticeFailure(f"{name}: max abs error {err.max().item():.3g} > tolerance {atol:g} "
                              f"(worst at {where}: got {a[tuple(where)].item():.6g}, "
                              f"expected {e[tuple(where)].item():.6g})", hint)


def check_dtype(name: str, t, dtype, hint: str | None = None) -> None:
    if t.dtype != dtype:
        raise PracticeFailure(f"{name} has dtype {t.dtype}, expected {dtype}", hint)


# ---------------------------------------------------------------------------------------------------
# Step 1: online softmax
# ---------------------------------------------------------------------------------------------------
def _stats_case(x: torch.Tensor, block: int):
    def run(impl):
        m, l = impl.online_softmax_stats(x, block)
        compare("m", m, x.amax(dim=-1), 0.0)
        compare("lse_from_stats(m, l)", impl.lse_from_stats(m, l), logsumexp_truth(x), 1e-12)
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


def _update_case(x: torch.Tensor):
    def run(impl):
        m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype)
        m, l = impl.online_softmax_update(m, torch.zeros_like(m), x)
        compare("lse after one update from the empty state", impl.lse_from_stats(m, l), logsumexp_truth(x), 1e-12,
                HINT_NEG_INF)
    return run


# --8<-- [start:cases]
def online_softmax_cases() -> list[Case]:
    rising = torch.linspace(-3.0, 40.0, 37, dtype=torch.float64).repeat(3, 1)  # a new max in every block
    rows = randn(4, 37) * 5
    masked_prefix = rows.clone()
    masked_prefix[:, :9] = float("-inf")  # the first blocks hold nothing but -inf
    all_masked = torch.full((2, 10), float("-inf"), dtype=torch.float64)
    return [
        Case("update from the empty state, one block of 8 columns", _update_case(rows[:, :8]), HINT_NEG_INF),
        Case("stats, a rising row of 37 columns in blocks of 8", _stats_case(rising, 8), HINT_RESCALE),
        Case("stats, random rows of 37 columns in blocks of 5", _stats_case(rows, 5), HINT_RESCALE),
        Case("stats, block of 1 column", _stats_case(rows, 1), HINT_RESCALE, fast=False),
        Case("stats, block wider than the row (64 > 37)", _stats_case(rows, 64), HINT_RESCALE, fast=False),
        Case("stats, first 9 columns -inf, blocks of 4", _stats_case(masked_prefix, 4), HINT_NEG_INF),
        Case("stats, 2 rows of 10 columns all -inf (lse must be -inf)", _stats_case(all_masked, 4), HINT_NEG_INF),
        Case("merge two halves cut at column 13", _merge_case(rows, 13, 4), HINT_RESCALE),
    ]
# --8<-- [end:cases]


# ---------------------------------------------------------------------------------------------------
# Steps 2 and 3: the tiled forward, then causal masking and tile skipping
# ---------------------------------------------------------------------------------------------------
def _forward_case(B, H, Tq, Tk, D, block_q, block_k, causal=False, alignment="upper_left", scale=None,
                  dtype=torch.float64, seed=0):
    def run(impl):
        q, k, v = (randn(B, H, T, D, dtype=dtype, seed=seed + i) for i, T in enumerate((Tq, Tk, Tk)))
        o, lse = impl.flash_attention_forward(q, k, v, causal=causal, scale=scale, block_q=block_q,
                                              block_k=block_k, alignment=alignment)
        o_ref, lse_ref = attention_truth(q, k, v, causal, scale, alignment)
        check_dtype("o", o, dtype)
        atol = 1e-10 if dtype == torch.float64 else 2e-3
        compare("o", o, o_ref, atol, HINT_NEG_INF if causal and Tq > Tk else None)
        stat = torch.float64 if dtype == torch.float64 else torch.float32
        check_dtype("lse", lse, stat, HINT_LSE)
        compare("lse", lse, lse_ref, 1e-10 if dtype == torch.float64 else 1e-5, HINT_LSE)
    return run


def _shape(B, H, Tq, Tk, D, block_q, block_k, causal=False, alignment="upper_left"):
    mask = f"causal {alignment}" if causal else "no mask"
    return f"B={B} H={H} Tq={Tq} Tk={Tk} D={D}, block_q={block_q} block_k={block_k}, {mask}"


def forward_cases() -> list[Case]:
    shapes = [
        ((1, 2, 32, 32, 8, 16, 16), "blocks divide T", True),
        ((1, 2, 20, 37, 8, 16, 16), "Tq != Tk, blocks do not divide them", True),
        ((2, 1, 9, 33, 4, 4, 8), "block_q != block_k", False),
    ]
    cases = [Case(f"{_shape(*s)} ({why})", _forward_case(*s), HINT_RESCALE, fast) for s, why, fast in shapes]
    cases.append(Case(f"{_shape(1, 2, 16, 24, 8, 8, 8)}, scale τ = 0.3",
                      _forward_case(1, 2, 16, 24, 8, 8, 8, scale=0.3), HINT_SCALE))
    cases.append(Case(f"{_shape(1, 1, 24, 24, 16, 8, 8)}, float16 inputs (lse must stay float32)",
                      _forward_case(1, 1, 24, 24, 16, 8, 8, dtype=torch.float16), HINT_LSE))
    return cases


def causal_cases() -> list[Case]:
    shapes = [
        ((1, 2, 32, 32, 8, 16, 16, True, "upper_left"), "blocks divide T", True),
        ((1, 2, 37, 37, 8, 16, 16, True, "upper_left"), "ragged last tiles", True),
        ((1, 2, 37, 37, 8, 8, 16, True, "upper_left"), "block_q < block_k", False),
        ((1, 2, 20, 37, 8, 16, 8, True, "lower_right"), "Tq < Tk: the diagonal ends bottom-right", True),
    ]
    cases = [Case(f"{_shape(*s)} ({why})", _forward_case(*s), HINT_SKIP, fast) for s, why, fast in shapes]
    cases.append(Case(f"{_shape(1, 2, 40, 13, 8, 16, 16, True, 'lower_right')} (the first 27 rows see no key)",
                      _forward_case(1, 2, 40, 13, 8, 16, 16, True, "lower_right"), HINT_NEG_INF))
    return cases


# ---------------------------------------------------------------------------------------------------
# Step 4: the tiled backward (fed the truth's o and lse, so it is judged on its own)
# ---------------------------------------------------------------------------------------------------
def _backward_case(B, H, Tq, Tk, D, block_q, block_k, causal=False, alignment="upper_left", seed=0):
    def run(impl):
        q, k, v = (randn(B, H, T, D, seed=seed + i) for i, T in enumerate((Tq, Tk, Tk)))
        do = randn(B, H, Tq, D, seed=seed + 3)
        o, lse, dq_ref, dk_ref, dv_ref = attention_grads_truth(q, k, v, do, causal, None, alignment)
        dq, dk, dv = impl.flash_attention_backward(q, k, v, o, lse, do, causal=causal, scale=None,
                                                   block_q=block_q, block_k=block_k, alignment=alignment)
        hint = HINT_MASK_BACKWARD if causal else None
        compare("dv", dv, dv_ref, 1e-10, hint)
        compare("dk", dk, dk_ref, 1e-10, hint)
        compare("dq", dq, dq_ref, 1e-10, hint)
    return run


def backward_cases() -> list[Case]:
    shapes = [
        ((1, 2, 32, 32, 8, 16, 16), "blocks divide T", True),
        ((1, 2, 20, 37, 8, 16, 8), "Tq != Tk, ragged tiles", True),
        ((1, 2, 37, 37, 8, 16, 16, True, "upper_left"), "causal, ragged tiles", True),
        ((1, 1, 20, 37, 8, 8, 16, True, "lower_right"), "causal, Tq < Tk", False),
        ((1, 1, 40, 13, 8, 16, 16, True, "lower_right"), "rows that see no key get zero gradients", False),
    ]
    return [Case(f"{_shape(*s)} ({why})", _backward_case(*s),
                 HINT_MASK_BACKWARD if len(s) > 7 else "dS = P * (dP - D) with D = rowsum(dO * O)", fast)
            for s, why, fast in shapes]


# ---------------------------------------------------------------------------------------------------
# Step 5: the fused softmax kernel (Triton)
# ---------------------------------------------------------------------------------------------------
def _softmax_case(rows, cols, block=None, dtype=torch.float32, neg_inf_prefix=0):
    def run(impl):
        x = randn(rows, cols, dtype=dtype) * 3
        if neg_inf_prefix:
            x[:, :neg_inf_prefix] = float("-inf")
        y = impl.softmax(x.to(device()), block=block) if block else impl.softmax(x.to(device()))
        check_dtype("softmax(x)", y, dtype)
        compare("softmax(x)", y, softmax_truth(x), 1e-5 if dtype == torch.float32 else 2e-3,
                HINT_NEG_INF if neg_inf_prefix else None)
    return run


def fused_softmax_cases() -> list[Case]:
    return [
        Case("x (4, 16): the row fits one power-of-two block", _softmax_case(4, 16), "one program per row"),
        Case("x (3, 37): 37 columns, not a power of two", _softmax_case(3, 37), HINT_ARANGE),
        Case("x (2, 100), block=32: the row streams in 4 blocks", _softmax_case(2, 100, block=32), HINT_RESCALE),
        Case("x (2, 100), block=32, first 40 columns -inf", _softmax_case(2, 100, 32, neg_inf_prefix=40),
             HINT_NEG_INF, fast=False),
        Case("x (3, 50) float16", _softmax_case(3, 50, dtype=torch.float16), "compute m and l in float32",
             fast=False),
    ]


# ---------------------------------------------------------------------------------------------------
# Step 6: the forward kernel (Triton); float32 and float16 only, never bfloat16 in the interpreter
# ---------------------------------------------------------------------------------------------------
def _kernel_case(B, H, Tq, Tk, D, block_q, block_k, causal=False, alignment="upper_left", dtype=torch.float32,
                 transposed=False):
    def run(impl):
        def make(T, seed):
            if transposed:  # (B, T, H, D) as a model's projection gives it, viewed as (B, H, T, D)
                return randn(B, T, H, D, dtype=dtype, seed=seed).to(device()).transpose(1, 2)
            return randn(B, H, T, D, dtype=dtype, seed=seed).to(device())

        q, k, v = make(Tq, 0), make(Tk, 1), make(Tk, 2)
        o, lse = impl.flash_attention(q, k, v, causal=causal, alignment=alignment, block_q=block_q, block_k=block_k)
        o_ref, lse_ref = attention_truth(q, k, v, causal, None, alignment)
        check_dtype("o", o, dtype)
        check_dtype("lse", lse, torch.float32, HINT_LSE)
        hint = HINT_STRIDES if transposed else HINT_NEG_INF if causal and Tq > Tk else None
        hint = hint or (HINT_PADDED if Tk % block_k else None)
        fp32 = 5e-5  # full-fp32 dots; the compiled kernel's exp2 and reduction order differ from the CPU's
        compare("o", o, o_ref, fp32 if dtype == torch.float32 else 3e-3, hint)
        compare("lse", lse, lse_ref, fp32 if dtype == torch.float32 else 1e-4, hint or HINT_LSE)
    return run


def forward_kernel_cases() -> list[Case]:
    return [
        Case(_shape(1, 2, 32, 32, 16, 16, 16) + " (blocks divide T)", _kernel_case(1, 2, 32, 32, 16, 16, 16),
             HINT_RESCALE),
        Case(_shape(1, 2, 20, 37, 16, 16, 16) + " (Tk = 37: 11 padded keys in the last tile)",
             _kernel_case(1, 2, 20, 37, 16, 16, 16), HINT_PADDED),
        Case(_shape(1, 1, 37, 37, 16, 16, 16, True) + " (ragged diagonal tile)",
             _kernel_case(1, 1, 37, 37, 16, 16, 16, True), HINT_SKIP),
        Case(_shape(1, 1, 40, 13, 16, 16, 16, True, "lower_right") + " (the first 27 rows see no key)",
             _kernel_case(1, 1, 40, 13, 16, 16, 16, True, "lower_right"), HINT_NEG_INF),
        Case(_shape(1, 2, 37, 37, 16, 16, 16, True) + ", q/k/v are transposed (B, T, H, D) views",
             _kernel_case(1, 2, 37, 37, 16, 16, 16, True, transposed=True), HINT_STRIDES),
        Case(_shape(1, 1, 20, 20, 24, 16, 16) + " (D = 24 is not a power of two)",
             _kernel_case(1, 1, 20, 20, 24, 16, 16), "pad the head dim to a power of two and mask it",
             fast=False),
        Case(_shape(1, 1, 32, 32, 16, 16, 16) + ", float16 inputs",
             _kernel_case(1, 1, 32, 32, 16, 16, 16, dtype=torch.float16), HINT_LSE, fast=False),
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
    return f"{type(exc).__name__}: {first[:400]}{where}"


# --8<-- [start:run_step]
def run_step(step: Step, impl: ModuleType, fast: bool = False, stop_at_first_failure: bool = False,
             on_case: Callable[[Case, bool], None] | None = None) -> StepResult:
    """Run every case of ``step`` against ``impl``; never raises for a failing case."""
    result = StepResult(step)
    cases = [c for c in step.cases() if c.fast or not fast]
    for n, case in enumerate(cases):
        missing = [f for f in step.functions if not callable(getattr(impl, f, None))]
        try:
            if missing:
                raise PracticeFailure(f"the module defines no {', '.join(missing)}")
            case.run(impl)
        except NotImplementedError as exc:  # an untouched skeleton: every remaining case fails the same way
            hint = f"write {', '.join(step.functions)} in {step.file}.py"
            result.failures.append(Failure(case.name, _short_error(exc), hint, step.chapter))
            result.skipped = len(cases) - n - 1
            if on_case:
                on_case(case, False)
            break
        except Exception as exc:  # the implementation's own error is a failure of this case, not a crash
            hint = getattr(exc, "hint", None) or case.hint
            result.failures.append(Failure(case.name, _short_error(exc), hint, step.chapter))
            if on_case:
                on_case(case, False)
            if stop_at_first_failure:
                result.skipped = len(cases) - n - 1
                break
            continue
        result.passed += 1
        if on_case:
            on_case(case, True)
    return result
# --8<-- [end:run_step]
