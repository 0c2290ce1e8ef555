"""The fused row softmax against float64 torch.softmax, one block per row and streamed."""

import pytest
import torch

from flashtile.kernels import softmax as softmax_module
from flashtile.kernels.softmax import softmax

from ._helpers import DEVICE, randn

SOFTMAX_TOL = {  # the output is rounded to the input dtype; the statistics are fp32
    torch.float32: dict(atol=1e-6, rtol=1e-5),
    torch.float16: dict(atol=1e-6, rtol=1e-3),
}


def _check(x, y):
    assert y.dtype == x.dtype and y.shape == x.shape
    expected = torch.softmax(x.double(), dim=-1)
    torch.testing.assert_close(y.double().cpu(), expected.cpu(), **SOFTMAX_TOL[x.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("width", [37, 128, 1000])
def test_softmax_matches_torch_in_one_block_for_any_width(width, dtype):
    x = randn(6, width, dtype=dtype) * 4  # spread-out logits, so the max really matters
    _check(x, softmax(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softmax_streams_rows_wider_than_one_block(dtype):
    x = randn(3, 1000, dtype=dtype) * 4
    _check(x, softmax(x, block=64))  # 16 column blocks, the last one ragged


def test_softmax_streams_by_default_when_a_row_exceeds_the_largest_block():
    width = softmax_module.INTERPRETER_MAX_BLOCK + 977 if DEVICE == "cpu" else 100_000
    x = randn(2, width) * 4
    _check(x, softmax(x))


def test_softmax_streaming_survives_a_block_of_minus_inf_before_the_first_finite_value():
    # A masked prefix: the first two blocks are all -inf, so the running max is still -inf there.
    x = randn(2, 100) * 4
    x[:, :40] = float("-inf")
    y = softmax(x, block=16)
    assert not torch.isnan(y).any()
    _check(x, y)


def test_softmax_flattens_leading_dims_and_reads_any_strides():
    x = randn(5, 3, 70).transpose(0, 2)  # (70, 3, 5), the softmax dim has stride 210
    assert x.stride(-1) != 1
    _check(x, softmax(x))
    _check(x, softmax(x, block=16))


def test_softmax_kernel_itself_reads_a_column_stride():
    # A transposed matrix: flattening it to rows is a view, so the kernel gets stride_xc = 40, not a copy.
    x = randn(40, 70).t()  # (70, 40), stride (1, 70)
    rows = x.reshape(-1, x.shape[-1])
    assert rows.data_ptr() == x.data_ptr() and rows.stride(1) == 70
    _check(x, softmax(x))  # one block per row
    _check(x, softmax(x, block=16))  # the streaming kernel


@pytest.mark.parametrize(
    "x,error,match",
    [
        ([1.0, 2.0], TypeError, "x must be a torch.Tensor"),
        (torch.ones(4, 4, dtype=torch.float64), TypeError, "x must have dtype in"),
        (torch.ones(4, 4, dtype=torch.int32), TypeError, "x must have dtype in"),
        (torch.tensor(1.0), ValueError, "at least one dimension"),
    ],
)
def test_softmax_rejects_bad_input(x, error, match):
    if isinstance(x, torch.Tensor):
        x = x.to(DEVICE)
    with pytest.raises(error, match=match):
        softmax(x)


def test_softmax_rejects_a_block_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="block must be a power of two"):
        softmax(randn(2, 10), block=48)


def test_softmax_rejects_cpu_tensors_when_not_interpreting(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="x is on cpu, but Triton kernels need a CUDA device"):
        softmax(torch.randn(2, 10))


def test_softmax_of_an_empty_tensor_is_empty():
    assert softmax(randn(0, 10)).shape == (0, 10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 arithmetic is only right on a GPU")
@pytest.mark.parametrize("width", [37, 1000, 100_000])
def test_softmax_matches_torch_in_bf16_on_gpu(width):
    x = randn(64, width, dtype=torch.bfloat16) * 4
    y = softmax(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), torch.softmax(x.double(), -1), atol=1e-6, rtol=8e-3)
