"""One meaning per name across the tiers: a function of ``flashtile.kernels`` that has the name of one in
``flashtile.reference`` takes the same positional arguments in the same order.

A caller that swaps tiers (the public API does, per backend) must not have its arguments read as
something else: ``causal, scale, alignment`` on one tier and ``causal, scale, block_q`` on the other
would run with a tile size of "upper_left" or, worse, with a number where the mask was meant. Keyword-only
extras of a kernel (``stats``, ``tma``) are free; a constexpr's capitals count as the same name.
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


def test_functions_that_share_a_name_across_the_tiers_share_their_positional_arguments():
    reference, kernels = tier_functions(flashtile.reference), tier_functions(flashtile.kernels)
    shared = sorted(set(reference) & set(kernels))
    assert {"flash_attention_backward", "last_key_tile", "first_key_tile"} <= set(shared)  # the pairs it exists for
    for name in shared:
        (ref_module, ref_fn), (ker_module, ker_fn) = reference[name], kernels[name]
        assert positional(ker_fn) == positional(ref_fn), f"{ker_module}.{name} vs {ref_module}.{name}"
