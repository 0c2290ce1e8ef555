"""``flashtile._layouts``: the strides of outputs that do not exist yet."""

from __future__ import annotations

import torch

from flashtile._layouts import contiguous_strides, empty_like_layout, strides_like


def test_contiguous_strides_are_what_torch_empty_gets():
    for shape in [(2, 3, 5, 7), (1, 1, 1, 1), (4, 0, 3), (6,)]:
        assert contiguous_strides(shape) == torch.empty(shape).stride()


def test_a_dense_permuted_view_keeps_its_layout():
    bthd = torch.empty(2, 7, 3, 5).transpose(1, 2)  # (B, H, T, D) over (B, T, H, D) memory
    assert strides_like(bthd) == bthd.stride() == (105, 5, 15, 1)
    head_dim_outer = torch.empty(2, 5, 3, 7).permute(0, 2, 3, 1)
    assert strides_like(head_dim_outer) == head_dim_outer.stride()
    ones = torch.empty(1, 3, 1, 5)[:, :, :, :]  # size-1 dims: any stride is dense
    assert strides_like(ones) == ones.stride()


def test_anything_not_dense_gets_contiguous_strides():
    base = torch.empty(2, 3, 8, 6)
    for x in (base[..., :4], base[:, :, ::2], torch.empty(2, 1, 5, 4).expand(2, 3, 5, 4), base.flip(2),
              base[:, :, :0]):  # a gap, a step, an overlap, a negative stride, no elements
        assert strides_like(x) == contiguous_strides(x.shape), x.stride()


def test_empty_like_layout_allocates_with_the_strides_and_dtype():
    x = torch.empty(2, 7, 3, 5).transpose(1, 2)
    y = empty_like_layout(x, strides_like(x), dtype=torch.float16)
    assert y.shape == x.shape and y.stride() == x.stride() and y.dtype == torch.float16 and y.device == x.device
