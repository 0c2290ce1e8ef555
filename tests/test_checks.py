"""Bad input gets a clear ValueError or TypeError that names the argument, from every entry point."""

import pytest
import torch

from flashtile.reference.backward import flash_attention_backward
from flashtile.reference.forward import flash_attention_forward
from flashtile.reference.naive import naive_attention
from flashtile.reference.online_softmax import online_softmax_stats


def qkv(B=1, H=2, H_kv=2, Tq=5, Tk=5, D=4, dtype=torch.float64):
    return torch.randn(B, H, Tq, D, dtype=dtype), torch.randn(B, H_kv, Tk, D, dtype=dtype), torch.randn(
        B, H_kv, Tk, D, dtype=dtype
    )


ENTRY_POINTS = {
    "naive": lambda q, k, v, **kw: naive_attention(q, k, v, **kw),
    "forward": lambda q, k, v, **kw: flash_attention_forward(q, k, v, **kw),
}


@pytest.fixture(params=sorted(ENTRY_POINTS))
def attend(request):
    return ENTRY_POINTS[request.param]


def test_wrong_rank(attend):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q must be a rank-4 tensor"):
        attend(q[0], k, v)
    with pytest.raises(ValueError, match=r"k must be a rank-4 tensor"):
        attend(q, k[..., None], v)


def test_not_a_tensor(attend):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"v must be a torch.Tensor, got list"):
        attend(q, k, v.tolist())


def test_mismatched_batch(attend):
    q, k, v = qkv()
    k2, v2 = torch.cat([k, k]), torch.cat([v, v])
    with pytest.raises(ValueError, match=r"batch"):
        attend(q, k2, v2)


def test_mismatched_head_dim(attend):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"head dim"):
        attend(q, k[..., :3], v[..., :3])


def test_v_shape_differs_from_k(attend):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"v must have the same shape as k"):
        attend(q, k, v[:, :, :3])


def test_heads_not_a_multiple_of_kv_heads(attend):
    q, k, v = qkv(H=3, H_kv=2)
    with pytest.raises(ValueError, match=r"multiple of the number of key/value heads"):
        attend(q, k, v)


def test_dtype_mismatch(attend):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"k has dtype torch.float32 but q has dtype torch.float64"):
        attend(q, k.float(), v)


def test_integer_dtype(attend):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"q must have dtype in"):
        attend(q.long(), k.long(), v.long())


def test_device_mismatch(attend):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"v is on meta but q is on cpu"):
        attend(q, k, v.to("meta"))


@pytest.mark.parametrize("dim", [0, 2, 3])
def test_empty_tensors(attend, dim):
    q, k, v = qkv()
    empty = q.narrow(dim, 0, 0)
    with pytest.raises(ValueError, match=r"q is empty"):
        attend(empty, k, v)


def test_empty_keys(attend):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"k is empty"):
        attend(q, k[:, :, :0], v[:, :, :0])


def test_bad_causal_scale_alignment(attend):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"causal must be a bool"):
        attend(q, k, v, causal="yes")
    with pytest.raises(TypeError, match=r"scale must be a real number or None"):
        attend(q, k, v, scale="0.5")
    with pytest.raises(ValueError, match=r"scale must be finite"):
        attend(q, k, v, scale=float("nan"))
    with pytest.raises(ValueError, match=r"alignment must be one of"):
        attend(q, k, v, causal=True, alignment="bottom")


@pytest.mark.parametrize("block_q,block_k,exc,name", [(0, 4, ValueError, "block_q"), (4, -1, ValueError, "block_k"),
                                                      (2.0, 4, TypeError, "block_q"), (4, True, TypeError, "block_k")])
def test_non_positive_or_non_int_blocks(block_q, block_k, exc, name):
    q, k, v = qkv()
    with pytest.raises(exc, match=name):
        flash_attention_forward(q, k, v, block_q=block_q, block_k=block_k)
    o, lse = naive_attention(q, k, v)
    with pytest.raises(exc, match=name):
        flash_attention_backward(q, k, v, o, lse, o, block_q=block_q, block_k=block_k)


def test_backward_checks_o_do_and_lse_shapes():
    q, k, v = qkv()
    o, lse = naive_attention(q, k, v)
    with pytest.raises(ValueError, match=r"do must have shape"):
        flash_attention_backward(q, k, v, o, lse, o[..., :2, :])
    with pytest.raises(ValueError, match=r"lse must have shape \(B, H, Tq\)"):
        flash_attention_backward(q, k, v, o, lse[..., :3], o)
    with pytest.raises(TypeError, match=r"o has dtype"):
        flash_attention_backward(q, k, v, o.float(), lse, o)


def test_online_softmax_rejects_bad_block_and_empty_rows():
    x = torch.randn(3, 5)
    with pytest.raises(ValueError, match="block"):
        online_softmax_stats(x, 0)
    with pytest.raises(ValueError, match="at least one column"):
        online_softmax_stats(x[:, :0], 2)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        online_softmax_stats([1.0, 2.0], 2)


def test_a_remembered_fact_lasts_until_its_tensor_is_written_to():
    from flashtile._plans import _facts, recall_fact, remember_fact

    x = torch.arange(6, dtype=torch.int32)
    remember_fact("values", x, [0, 1, 2, 3, 4, 5])
    assert recall_fact("values", x) == [0, 1, 2, 3, 4, 5]
    assert recall_fact("checked", x, "none") == "none"  # each kind of fact on its own
    assert recall_fact("values", x.clone()) is None  # another tensor with the same values
    x[2:4].add_(1)  # an in-place write through a view advances the version count x shares
    assert recall_fact("values", x) is None
    with torch.inference_mode():
        y = torch.ones(3)
    remember_fact("values", y, [1.0, 1.0, 1.0])  # no version count to watch: not kept
    assert recall_fact("values", y) is None
    z = torch.zeros(2)
    remember_fact("values", z, [0.0, 0.0])
    key = id(z)
    del z  # the fact leaves with its tensor, so a new tensor given the same id cannot inherit it
    assert not any(k[1] == key for k in _facts)


@pytest.mark.parametrize("scale", [1.0, -0.3, 1e-20, 1e-37, 9e-39, 7e-39, 1e-45, 0.0, 2.0e30])
def test_the_sink_limit_divides_by_the_unit_the_kernels_divide_by(scale):
    """``sink_limit`` bounds sink / |τ| with the |τ| the kernels use (``kernel_scale``: 1 where τ is too
    small for float32), and sink * log2(e) always; a softcap lifts the first bound, float64 has none."""
    import math

    from flashtile._checks import FLOAT32_MAX, sink_limit
    from flashtile.kernels._host import kernel_scale

    unit = kernel_scale(scale).unit
    expected = min(FLOAT32_MAX / math.log2(math.e), FLOAT32_MAX * unit) / 2
    assert sink_limit(scale, None, torch.float32) == expected
    assert sink_limit(scale, 5.0, torch.bfloat16) == FLOAT32_MAX / math.log2(math.e) / 2
    assert sink_limit(scale, None, torch.float64) == math.inf
