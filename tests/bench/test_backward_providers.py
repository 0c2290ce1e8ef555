"""The backward table's launcher providers (atomic dQ, TMA loads) are the kernels' opt-in paths behind
autograd, with the float64 gradients.

Runs in Triton's interpreter on the CPU (the root conftest sets TRITON_INTERPRET=1); the truth is autograd
through the independent float64 formula of tests/_truth.py.
"""

import pytest
import torch

from flashtile.bench.backward import LauncherBackward
from tests._truth import truth_with_grads


@pytest.mark.parametrize("options", [dict(deterministic=False), dict(tma=True)], ids=["atomic_dq", "tma"])
def test_launcher_providers_give_float64_gradients_through_autograd(options):
    gen = torch.Generator().manual_seed(3)
    q, do = torch.randn(1, 4, 29, 32, generator=gen), torch.randn(1, 4, 29, 32, generator=gen)
    k, v = torch.randn(1, 2, 29, 32, generator=gen), torch.randn(1, 2, 29, 32, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = LauncherBackward.apply(*leaves, True, options)
    o.backward(do)
    o_ref, _, grads_ref = truth_with_grads(q, k, v, do, True, None, "upper_left")
    torch.testing.assert_close(o.detach().double(), o_ref, atol=1e-5, rtol=1e-5)
    for leaf, g in zip(leaves, grads_ref):
        torch.testing.assert_close(leaf.grad.double(), g, atol=1e-4, rtol=1e-4)
