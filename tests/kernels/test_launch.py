"""The launch path: a plan worked out once per layout must never let a bad argument through.

``_plans.cached_plan`` skips the checks for a layout and flags it has seen before. These tests make a
valid call first, so that its plan is cached, then an invalid call that differs from it in only one
thing, and require the same error a fresh process would give (the contract is one answer per input,
whatever ran before). They run the kernels through the interpreter on the CPU.
"""

from types import SimpleNamespace

import pytest
import torch

from flashtile import _plans
from flashtile.kernels import _host
from flashtile.kernels.decode import flash_decode
from flashtile.kernels.forward import checked_forward_plan, flash_attention
from tests._truth import attention_truth

from ._helpers import DEVICE, FORWARD_TOL, randn

LAUNCH = dict(grid=(1,), scalars=(), constexprs={}, num_warps=4, num_stages=3)  # a stand-in launch's settings


def _qkv(T=40, D=32, dtype=torch.float32):
    return randn(1, 2, T, D, dtype=dtype), randn(1, 2, T, D, dtype=dtype), randn(1, 2, T, D, dtype=dtype)


@pytest.mark.parametrize(
    ("changed", "error"),
    [
        (dict(causal=1), TypeError),  # 1 == True and hash(1) == hash(True): the key must tell them apart
        (dict(causal="yes"), TypeError),
        (dict(scale=float("nan")), ValueError),
        (dict(alignment="lower_left"), ValueError),
        (dict(block_q=24), ValueError),
        (dict(return_stats=1), TypeError),
        (dict(tma=[True]), TypeError),  # unhashable: no key at all, straight to the checks
    ],
)
def test_a_cached_plan_does_not_let_a_bad_flag_through(changed, error):
    q, k, v = _qkv()
    good = dict(causal=True, scale=0.3, alignment="upper_left", block_q=16, return_stats=True, tma=False)
    flash_attention(q, k, v, **good)  # cached now
    with pytest.raises(error):
        flash_attention(q, k, v, **{**good, **changed})


def test_a_cached_plan_does_not_let_a_bad_tensor_through():
    q, k, v = _qkv()
    flash_attention(q, k, v)
    with pytest.raises(TypeError, match="dtype"):
        flash_attention(q, k.double(), v)
    with pytest.raises(ValueError, match="head dim"):
        flash_attention(q, k[..., :16], v[..., :16])
    with pytest.raises(TypeError, match="torch.Tensor"):
        flash_attention(q, k.tolist(), v)


def test_the_same_layout_at_new_addresses_and_new_values_gives_each_call_its_own_answer():
    # Same shapes and strides, new tensors: the cached plan is reused, the data is not.
    for _ in range(3):
        q, k, v = _qkv(T=37, D=24)
        o, _ = flash_attention(q, k, v, causal=True)
        expected, _ = attention_truth(q.double(), k.double(), v.double(), causal=True)
        torch.testing.assert_close(o.double(), expected, **FORWARD_TOL[q.dtype])


def test_decode_plans_tell_a_missing_table_from_a_present_one():
    q = randn(2, 4, 1, 32)
    k, v = randn(2, 2, 48, 32), randn(2, 2, 48, 32)
    lengths = torch.tensor([48, 20], dtype=torch.int32, device=DEVICE)
    o_plain, _ = flash_decode(q, k, v, lengths)
    with pytest.raises(TypeError, match="block_table"):
        flash_decode(q, k, v, lengths, block_table=lengths.view(2, 1).to(torch.int64))
    o_again, _ = flash_decode(q, k, v, lengths)
    torch.testing.assert_close(o_again, o_plain, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_fast_launch_repeats_the_full_launch_bit_for_bit_and_specialises_on_alignment():
    q, k, v = _qkv(T=300, D=64, dtype=torch.float16)
    first, _ = flash_attention(q, k, v, causal=True)  # the full Triton path, which keeps the compiled kernel
    plan = next(plan for key, plan in _plans._plans.items()
                if key[0] is checked_forward_plan and key[1][1:4:2] == (q.shape, q.dtype))  # fmt: skip
    assert len(plan.launch._compiled) == 1
    for _ in range(3):  # the fast path
        again, _ = flash_attention(q, k, v, causal=True)
        assert torch.equal(again, first)
    # The same layout 2 bytes past a 16-byte boundary: Triton compiles another kernel for it.
    storage = torch.randn(3 * q.numel() + 8, device="cuda").to(torch.float16)
    shifted = [storage[1 + i * q.numel() : 1 + (i + 1) * q.numel()].view(q.shape) for i in range(3)]
    assert all(x.data_ptr() % 16 for x in shifted)
    for _ in range(2):
        o, _ = flash_attention(*shifted, causal=True)
        expected, _ = attention_truth(*(x.double() for x in shifted), causal=True)
        torch.testing.assert_close(o.double(), expected, **FORWARD_TOL[torch.float16])


def test_a_launch_remembers_a_bounded_number_of_specialisations(monkeypatch):
    class StandIn(_host.KernelLaunch):  # Triton's full path stood in for: compiles nothing
        __slots__ = ()

        def _full_launch(self, tensors):
            return SimpleNamespace(run=None, function=None, packed_metadata=None)

    monkeypatch.setattr(_host, "MAX_COMPILED", 2)
    kernel_launch = StandIn(SimpleNamespace(arg_names=["x"]), **LAUNCH)
    for dtype in (torch.float32, torch.float16, torch.int32):  # three specialisations
        kernel_launch._compile_and_launch((torch.empty(8, dtype=dtype),), 0)
    assert 1 <= len(kernel_launch._compiled) <= 2


def test_outputs_allocated_per_call_stay_out_of_the_compiled_kernels_key():
    class StandIn(_host.KernelLaunch):  # Triton's full path stood in for: compiles nothing
        __slots__ = ()

        def _full_launch(self, tensors):
            return SimpleNamespace(run=None, function=None, packed_metadata=None)

    kernel_launch = StandIn(SimpleNamespace(arg_names=["x", "out"]), **LAUNCH, fresh_outputs=1)
    x = torch.empty(8)
    for out in (torch.empty(8), torch.empty(9)[1:]):  # aligned and not: a fresh output is always aligned
        kernel_launch._compile_and_launch((x, out), 0)
    assert list(kernel_launch._compiled) == [(0, _host.specialization(x))]
    kernel_launch._compile_and_launch((torch.empty(9)[1:], torch.empty(8)), 0)  # an input's alignment is keyed
    assert len(kernel_launch._compiled) == 2


@pytest.mark.parametrize(("changed", "error"), [(dict(deterministic=1), TypeError), (dict(causal=0), TypeError)])
def test_a_cached_backward_plan_does_not_let_a_bad_flag_through(changed, error):
    from flashtile.kernels.backward import flash_attention_backward

    q, k, v = _qkv()
    do = randn(*q.shape)
    o, lse, stats = flash_attention(q, k, v, causal=True, return_stats=True)
    good = dict(causal=True, stats=stats, deterministic=True)
    first = flash_attention_backward(q, k, v, o, lse, do, **good)  # cached now
    again = flash_attention_backward(q, k, v, o, lse, do, **good)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    with pytest.raises(error):
        flash_attention_backward(q, k, v, o, lse, do, **{**good, **changed})
