"""A property test over shapes: whatever Tq, Tk, head dim, GQA ratio, mask and tiles, the kernel
agrees with float64 naive attention. Few examples, because each one runs through the interpreter."""

import pytest
import torch

from _truth import attention_truth
from flashtile.kernels.forward import flash_attention

from ._helpers import assert_attention_close, randn

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies


@hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
@hypothesis.given(
    Tq=st.integers(1, 70),
    Tk=st.integers(1, 70),
    D=st.sampled_from([16, 24, 48, 64]),
    H_kv=st.integers(1, 2),
    group=st.sampled_from([1, 2, 4]),
    mask=st.sampled_from([(False, "upper_left"), (True, "upper_left"), (True, "lower_right")]),
    block_q=st.sampled_from([16, 32]),
    block_k=st.sampled_from([16, 32]),
    seed=st.integers(0, 2**31 - 1),
)
def test_forward_matches_naive_for_any_shape(Tq, Tk, D, H_kv, group, mask, block_q, block_k, seed):
    causal, alignment = mask
    gen = torch.Generator().manual_seed(seed)
    q = randn(1, H_kv * group, Tq, D, generator=gen)
    k, v = randn(1, H_kv, Tk, D, generator=gen), randn(1, H_kv, Tk, D, generator=gen)
    o, lse = flash_attention(q, k, v, causal=causal, alignment=alignment, block_q=block_q, block_k=block_k)
    o_ref, lse_ref = attention_truth(q.double(), k.double(), v.double(), causal=causal, alignment=alignment)
    assert_attention_close(o, lse, o_ref, lse_ref, q.dtype)
