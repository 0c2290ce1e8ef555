"""One meaning per name across the tiers: a function of ``flashtile.kernels`` that has the name of one in
``flashtile.reference`` takes the same positional arguments in the same order, or a leading part of them
and the rest by keyword only, under the same names.

A caller that swaps tiers (the public API does, per backend) must not have its arguments read as
something else: ``causal, scale, alignment`` on one tier and ``causal, scale, block_q`` on the other
would run with a tile size of "upper_left" or, worse, with a number where the mask was meant. A kernel
launcher that takes its options by keyword only (``flash_attention_backward(q, k, v, o, lse, do, *,
causal, ...)``) refuses them positionally instead of misreading them, and a call by name means the same
on both tiers. Keyword-only extras of a kernel (``stats``, ``tma``) are free; a constexpr's capitals
count as the same name.
"""

import importlib
import inspect
import pkgutil

import flashtile.kernels
import flashtile.reference


def tier_functions(package) -> dict:
    """name -> (module, function) for every function a package's modules define at their top level."""
    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", obj)  # a @triton.jit helper: the Python function it wraps
            if inspect.isfunction(fn) and fn.__module__ == module.__name__ and not name.startswith("_"):
                found[name] = (module.__name__, fn)
    return found


def positional(fn) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name.lower() for p in inspect.signature(fn).parameters.values() if p.kind in kinds]


def keyword_only(fn) -> list[str]:
    return [p.name.lower() for p in inspect.signature(fn).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY]  # fmt: skip


def test_functions_that_share_a_name_across_the_tiers_share_their_positional_arguments():
    reference, kernels = tier_functions(flashtile.reference), tier_functions(flashtile.kernels)
    shared = sorted(set(reference) & set(kernels))
    assert {"flash_attention_backward", "last_key_tile", "first_key_tile"} <= set(shared)  # the pairs it exists for
    for name in shared:
        (ref_module, ref_fn), (ker_module, ker_fn) = reference[name], kernels[name]
        assert shares_its_arguments(ker_fn, ref_fn), f"{ker_module}.{name} vs {ref_module}.{name}"


def shares_its_arguments(ker_fn, ref_fn) -> bool:
    """The same leading positional arguments in the same order, and the rest by name only."""
    ours, theirs = positional(ker_fn), positional(ref_fn)
    return ours == theirs[: len(ours)] and set(theirs[len(ours):]) <= set(keyword_only(ker_fn))


def test_the_rule_above_catches_a_kernel_that_reads_an_option_as_another():
    """A control: a kernel that takes the reference's options positionally in another order fails the rule, and
    one that takes them by keyword only passes it."""

    def reference(q, k, v, causal=False, scale=None, alignment="upper_left"):
        pass

    def swapped(q, k, v, causal=False, alignment="upper_left", scale=None):
        pass

    def by_name(q, k, v, *, scale=None, causal=False, alignment="upper_left", tma=None):
        pass

    def too_few(q, k, v, *, causal=False, scale=None):  # alignment taken by neither position nor name
        pass

    assert shares_its_arguments(by_name, reference) and shares_its_arguments(reference, reference)
    assert not shares_its_arguments(swapped, reference) and not shares_its_arguments(too_few, reference)
