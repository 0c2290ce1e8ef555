"""Plans: a call's checks and derived settings, worked out once per layout of its tensors.

A launcher (or ``flashtile.attention``) validates its arguments and derives what it will launch from the
tensors' layouts and the flags alone, never from the values in the tensors. So the result for one layout
and one set of flags can be kept and reused: the checks run once, and every later call with the same
key skips them. This module holds that table; it imports no Triton, so the API can use it too.
"""

from __future__ import annotations

import torch

# --8<-- [start:plans]
MAX_PLANS = 1024
_plans: dict = {}


def layout_key(x: torch.Tensor | None) -> tuple | None:
    """All that the checks and the compiled kernel read from a tensor: everything but its values (and its
    type, so that a tensor subclass never shares a plan with a plain tensor; and its negative bit, which
    the checks refuse below the public entry points)."""
    if x is None:  # an optional tensor left out
        return None
    return type(x), x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16 == 0, x.is_neg()


def cached_plan(make_plan, tensors, *flags, **options):
    """``make_plan(*tensors, *flags, **options)``, worked out once per layout of the tensors and option values.

    A launcher's checks read only the tensors' layouts and the flags (with their types: ``True`` and
    ``1`` are different arguments), so a call whose key was seen before has passed them already, and
    gets the same launch. Anything that cannot form a key (a non-tensor, an unhashable flag) goes
    straight to ``make_plan``, whose checks say what is wrong.
    """
    try:
        key = (make_plan, *map(layout_key, tensors), *map(type, flags), *flags, *options,
               *map(type, options.values()), *options.values())  # flat: one tuple to hash  # fmt: skip
        plan = _plans.get(key)
    except (AttributeError, TypeError, RuntimeError):
        return make_plan(*tensors, *flags, **options)
    if plan is None:
        plan = keep(key, make_plan(*tensors, *flags, **options))
    return plan


def kept(key):
    """The plan kept under a key a caller built itself (``api.call_key``), or None: for a key never kept,
    for None (no key could be formed), and for a key that cannot be hashed (a list among the flags)."""
    try:
        return _plans.get(key)
    except TypeError:
        return None


def keep(key, plan):
    """Keep ``plan`` under ``key`` and return it; nothing is kept under None or under a key that cannot be hashed."""
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
