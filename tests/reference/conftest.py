import pytest
import torch


@pytest.fixture
def rand():
    """Fresh float64 normal tensors from a generator seeded per test (reproducible, never zeros)."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)

    def make(*shape, dtype=torch.float64, scale=1.0):
        return scale * torch.randn(*shape, generator=gen, dtype=dtype)

    return make
