"""The backward table's atomic-dQ provider is the kernels' opt-in path behind autograd, with the same gradients.

Runs in Triton's interpreter on the CPU (the root conftest sets TRITON_INTERPRET=1); the truth is autograd
through the independent float64 formula of tests/_truth.py.
"""

import torch

from _truth import truth_with_grads
from flashtile.bench.backward import AtomicDq


def test_atomic_dq_provider_gives_float64_gradients_through_autograd():
    gen = torch.Generator().manual_seed(3)
    q, do = torch.randn(1, 4, 29, 32, generator=gen), torch.randn(1, 4, 29, 32, generator=gen)
    k, v = torch.randn(1, 2, 29, 32, generator=gen), torch.randn(1, 2, 29, 32, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = AtomicDq.apply(*leaves, True)
    o.backward(do)
    o_ref, _, grads_ref = truth_with_grads(q, k, v, do, True, None, "upper_left")
    torch.testing.assert_close(o.detach().double(), o_ref, atol=1e-5, rtol=1e-5)
    for leaf, g in zip(leaves, grads_ref):
        torch.testing.assert_close(leaf.grad.double(), g, atol=1e-4, rtol=1e-4)
