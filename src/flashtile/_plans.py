"""Every cache of the host path, in one place: what each holds, its key, and when it is dropped.

A launcher (or an entry point) validates its arguments and derives what it will launch from the tensors'
layouts and the options alone, never from the values in the tensors, so the result for one layout and one
set of options can be kept and reused; a few facts about tensor values are kept while the tensor is unchanged.
This module imports no Triton, so the entry points can use it too.

* **Plans** (``_plans``, through ``cached_plan``, ``keep_plan`` and ``kept_plan``): a checked call or a launch plan
  (``_dispatch.dense.AttentionCall``, ``_dispatch.decode.DecodeCall``, ``kernels.forward.ForwardPlan``,
  ``kernels.backward.BackwardPlan``, ``kernels.decode.DecodePlan``, ``fp8``'s plans). Key: the function that
  made it, ``layout_key`` of each tensor (type, shape, strides, dtype, device, 16-byte alignment, negative bit)
  and each option with its type (``True`` and ``1`` are different arguments); ``flashtile.attention`` builds
  its own flat key (``_dispatch.dense.call_key``). Dropped: all at once when ``MAX_PLANS`` are kept.
* **A kept call's kernel plans** (``AttentionCall.plans``, ``DecodeCall.plans``): the forward, decode and
  backward plans of one entry of the table above, filled by the call's first eager run; the backward ones
  keyed by the layout of do, dropped at ``_dispatch.dense.MAX_GRADIENT_LAYOUTS``. They go with their entry.
* **Facts about tensor values** (``_facts``, through ``remember_fact`` and ``recall_fact``): cu_seqlens' values
  read on the host (``_checks.host_values``), the packed documents' launch order (``kernels._host.
  document_order``), FP8 factors found positive and finite. Key: (what, id of the tensor); kept while it is
  the same object with the same version count and address. Dropped: when the tensor dies, and all at once at
  ``KEPT_FACTS``.
* **Compiled kernels of one launch** (``kernels._host.KernelLaunch._compiled``, the one place that reaches
  Triton's internals): Triton's launcher for each specialisation. Key: the device, and the dtype and 16-byte
  alignment of each tensor argument where the plan does not fix them. Dropped: all at once at
  ``kernels._host.MAX_COMPILED``, and with the plan that holds the launch.
* **Pure functions of small arguments** (``functools.cache``, never dropped): ``kernels.forward.forward_config``,
  the device's SM count (``_env.sm_count``) and compute capability (``kernels._host``), FP8's rotation matrices
  (``fp8.quantize``).
"""

from __future__ import annotations

import weakref

import torch

# --8<-- [start:plans]
MAX_PLANS = 1024
_plans: dict = {}


def layout_key(x: torch.Tensor | None) -> tuple | None:
    """All that the checks and the compiled kernel read from a tensor: everything but
    its values (and its type, so that a tensor subclass never shares a plan with a plain
    tensor; and its negative bit, which the checks refuse below the public entry
    points)."""
    if x is None:  # an optional tensor left out
        return None
    return (type(x), x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16 == 0,
            x.is_neg())


def cached_plan(make_plan, tensors, *values, names: tuple[str, ...] = ()):
    """``make_plan(*tensors, *values)``, worked out once per layout of the tensors and
    option values.

    ``names``: the keyword-only parameters of ``make_plan`` that the last ``len(names)``
    values fill, in that order (a plan builder takes its options by name; the key is
    built from the values alone, as cheaply as from positional flags, so every call of
    one ``make_plan`` passes the same names). A launcher's checks read only the tensors'
    layouts and the values (with their types: ``True`` and ``1`` are different
    arguments), so a call whose key was seen before has passed them already, and gets
    the same launch. Anything that cannot form a key (a non-tensor, an unhashable value)
    goes straight to ``make_plan``, whose checks say what is wrong.
    """
    try:
        # flat: one tuple to hash
        key = (make_plan, *map(layout_key, tensors), *map(type, values), *values)
        plan = _plans.get(key)
    except (AttributeError, TypeError, RuntimeError):
        return _make(make_plan, tensors, values, names)
    if plan is None:
        plan = keep_plan(key, _make(make_plan, tensors, values, names))
    return plan


def _make(make_plan, tensors, values, names):
    """``make_plan`` called with the values that ``names`` names as keywords, the others
    after the tensors."""
    if not names:
        return make_plan(*tensors, *values)
    leading = len(values) - len(names)
    return make_plan(*tensors, *values[:leading], **dict(zip(names, values[leading:])))


def kept_plan(key):
    """The plan kept under a key a caller built itself (``_dispatch.dense.call_key``),
    or None: for a key never kept, for None (no key could be formed), and for a key that
    cannot be hashed (a list among the flags)."""
    try:
        return _plans.get(key)
    except TypeError:
        return None


def keep_plan(key, plan):
    """Keep ``plan`` under ``key`` and return it; nothing is kept under None or under a
    key that cannot be hashed."""
    try:
        hash(key)
    except TypeError:
        return plan
    if key is not None:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    return plan
# --8<-- [end:plans]


# --- facts about tensor values ---------------------------------------------------------------------------

KEPT_FACTS = 256  # facts remember_fact keeps; past that it starts over
_facts: dict[tuple, tuple] = {}  # (what, id) -> (weak reference, version, address, fact)


def remember_fact(what: str, x: torch.Tensor, fact) -> None:
    """Keep ``fact`` (something learned by reading x's values: the values themselves, or that they passed a
    check) until x is written to. Reading a device tensor on the host waits for every kernel queued before
    it, so a fact read once per tensor and write saves a wait per call.

    ``recall_fact`` gives the fact back while it is the same tensor object (a weak reference: a new tensor at
    a reused id never matches) with the same version count (advanced by every in-place write through PyTorch,
    through any view of its memory) and address. Writes that bypass the version count (``.data``, a NumPy
    view, a kernel of one's own) are not seen: whoever relies on a fact must stay safe when it is stale.
    Tensors made under ``torch.inference_mode`` keep no version count: nothing is kept for them.
    """
    if x.is_inference():
        return
    key = (what, id(x))

    def forget(ref, key=key, facts=_facts):  # the tensor is gone; its id may be given to another one
        if facts.get(key, (None,))[0] is ref:  # (facts bound here: at interpreter exit the global may be None)
            del facts[key]

    if len(_facts) >= KEPT_FACTS:
        _facts.clear()
    _facts[key] = (weakref.ref(x, forget), x._version, x.data_ptr(), fact)


def recall_fact(what: str, x: torch.Tensor, default=None):
    """The fact ``remember_fact(what, x, fact)`` kept, if x is unchanged since; ``default`` otherwise."""
    entry = _facts.get((what, id(x)))
    if entry is None or entry[0]() is not x or x.is_inference() or (x._version, x.data_ptr()) != entry[1:3]:
        return default
    return entry[3]
