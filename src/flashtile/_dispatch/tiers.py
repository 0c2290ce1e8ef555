"""The tier choice and the modes every entry point treats alike: which tier runs a call (``pick_backend``,
``use_backend``), autocast, the autograd modes the custom ops refuse, and which inputs are plain tensors.

``flashtile.attention``, ``flashtile.attention_varlen`` and ``flashtile.decode_attention`` all ask this
module, so one input takes one tier and one mode gets one answer from every entry point.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch.autograd import forward_ad as _forward_ad

from .._env import constant_under_compile, is_interpreting

BACKENDS = ("triton", "reference")
_forced_backend: contextvars.ContextVar[str | None] = contextvars.ContextVar("flashtile_backend", default=None)


@contextlib.contextmanager
def use_backend(name: str):
    """Run every ``flashtile.attention`` call in the block on ``name`` ("triton" or "reference").

    float64 inputs take the reference tier even inside ``use_backend("triton")``: the kernels stop at fp32, and
    the module docstring's "float64 inputs always take the reference tier" holds with or without the override.

    The choice is a context variable: it holds for this thread (or asyncio task) only, so one thread's
    override never changes another's dispatch.
    """
    check_backend(name)
    token = _forced_backend.set(name)
    try:
        yield
    finally:
        _forced_backend.reset(token)


@constant_under_compile  # torch.compile reads it once, at trace time, like the rest of the dispatch
def forced_backend() -> str | None:
    """The backend a ``use_backend`` block forces in this thread or task, or None."""
    return _forced_backend.get()


def check_backend(name) -> str:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return name


# --8<-- [start:dispatch]
def pick_backend(q: torch.Tensor) -> str:
    """Which tier runs: see the module docstring. Read at trace time under
    torch.compile."""
    # before the forced tier: the kernels stop at fp32, use_backend or not
    if q.dtype == torch.float64:
        return "reference"
    forced = forced_backend()
    if forced is not None:
        return forced
    # a flag read, not a device object made and compared: every call passes here
    if q.is_cuda:
        return "triton"
    # the interpreter's bf16 is wrong: Triton issue 11584
    if is_interpreting() and q.dtype != torch.bfloat16:
        return "triton"
    return "reference"
# --8<-- [end:dispatch]


REFERENCE_BLOCK = 64  # the reference tier's tile size: any value gives the same result up to rounding

PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def plain_inputs(q, k, v) -> bool:
    """Plain tensors on a device the tiers take; anything else (meta tensors, fake tensors, subclasses)
    takes the custom op, whose fake implementation serves it."""
    return (
        type(q) in PLAIN_TENSORS and type(k) in PLAIN_TENSORS and type(v) in PLAIN_TENSORS
        and (q.is_cuda or q.is_cpu)
    )  # fmt: skip


def records_gradient(q, k, v, sinks=None) -> bool:
    """Whether autograd records this call: grad mode on and an input that requires a gradient (q, k, v, or
    the sinks where the call has them)."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (sinks is not None and sinks.requires_grad))  # fmt: skip



def refused_mode() -> bool:
    """Whether torch.func transforms or forward-mode AD are on, which ``refuse_unsupported_autograd_modes``
    refuses: one C call and one attribute, for the kept call's path (which then takes the full one)."""
    return _functorch_active() or _forward_ad._current_level >= 0


_functorch_active = torch._C._are_functorch_transforms_active
any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"))  # fmt: skip



def autocast_on(device: str) -> bool:
    """Whether torch.autocast is on for ``device`` (a device type), on the devices flashtile runs on."""
    return device in ("cuda", "cpu") and torch.is_autocast_enabled(device)


def no_autocast(device: str):
    """Autocast off for the tiers' own arithmetic; nothing to switch off (a no-op) where it is not on,
    which skips the context manager's cost on every ordinary call."""
    return torch.autocast(device, enabled=False) if autocast_on(device) else contextlib.nullcontext()


def autocast_inputs(query, key, value, device: str):
    """With torch.autocast on for ``device`` (the caller checked ``autocast_on``), the inputs cast to the
    autocast dtype, as scaled_dot_product_attention does (it is on autocast's lower-precision list);
    float64 inputs are left alone, as autocast leaves them."""
    if query.dtype == torch.float64:
        return query, key, value
    dtype = torch.get_autocast_dtype(device)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def autocast_sinks(sinks, dtype: torch.dtype):
    """The sinks beside inputs cast to ``dtype`` by autocast: as they are where float32 or ``dtype`` (the
    two dtypes a call of ``dtype`` inputs takes), float32 otherwise (the inputs' old 16-bit dtype: exact,
    and differentiable like any cast)."""
    if sinks is None or sinks.dtype == torch.float32 or sinks.dtype == dtype:
        return sinks
    return sinks.float()


def refuse_unsupported_autograd_modes() -> None:
    """Forward-mode AD and torch.func transforms would get a zero or missing tangent from the custom ops
    (they define a reverse-mode formula only): refuse them with a clear error instead."""
    if torch._C._are_functorch_transforms_active():
        raise NotImplementedError(
            "flashtile.attention does not support torch.func transforms (grad, vmap, jvp, jacrev, ...); "
            "use torch.autograd (loss.backward() or torch.autograd.grad)"
        )
    if torch.autograd.forward_ad._current_level >= 0:
        raise NotImplementedError(
            "flashtile.attention does not support forward-mode AD (torch.autograd.forward_ad); its gradient is "
            "reverse-mode only: use loss.backward() or torch.autograd.grad"
        )
