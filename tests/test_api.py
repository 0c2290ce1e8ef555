"""flashtile.attention: SDPA's call signature, autograd through the custom ops, torch.compile, bad input.

On a machine without CUDA, tensors are on the CPU and the Triton path runs in the interpreter (the root
conftest sets TRITON_INTERPRET=1); ``use_backend("reference")`` selects the PyTorch reference tier.
"""

import pytest
import torch
import torch.nn.functional as F

import flashtile
import flashtile._dispatch.dense
from flashtile.api import attention, attention_bwd, attention_fwd, pick_backend, use_backend
from tests._truth import attention_truth, definition_mask, masked_truth, truth_gradients, truth_with_grads

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, F16 = torch.float32, torch.float16
# fp32: exact dots in the interpreter; a GPU forward may run fp32 dots in tf32 (10-bit mantissa, like fp16).
TOL = {
    F32: dict(atol=1e-2, rtol=1e-2) if DEVICE == "cuda" else dict(atol=1e-4, rtol=1e-4),
    F16: dict(atol=1e-2, rtol=1e-2),
}


def make_qkv(B, H, H_kv, Tq, Tk, D, dtype=F32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, D, generator=gen).to(DEVICE, dtype).requires_grad_()
    k = torch.randn(B, H_kv, Tk, D, generator=gen).to(DEVICE, dtype).requires_grad_()
    v = torch.randn(B, H_kv, Tk, D, generator=gen).to(DEVICE, dtype).requires_grad_()
    return q, k, v


def float64_truth(q, k, v, do, causal, alignment):
    o, _, grads = truth_with_grads(q, k, v, do, causal, None, alignment)
    return o, grads


def run_attention(fn, q, k, v, do):
    """o and (dq, dk, dv) from fn(q, k, v) and .backward(do)."""
    for t in (q, k, v):
        t.grad = None
    o = fn(q, k, v)
    o.backward(do)
    return o, (q.grad, k.grad, v.grad)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("alignment", ["upper_left", "lower_right"])
def test_attention_backward_matches_float64_through_autograd(backend, dtype, alignment):
    q, k, v = make_qkv(1, 4, 1, 37, 29, 16, dtype, seed=1)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    with use_backend(backend):
        fn = lambda q, k, v: attention(q, k, v, is_causal=True, enable_gqa=True, alignment=alignment)
        o, grads = run_attention(fn, q, k, v, do)
    o_ref, grads_ref = float64_truth(q, k, v, do, True, alignment)
    torch.testing.assert_close(o.double(), o_ref, **TOL[dtype])
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert g.dtype == dtype, name
        torch.testing.assert_close(g.double(), g_ref, **TOL[dtype], msg=lambda m, name=name: f"{name}: {m}")


def test_attention_is_a_drop_in_for_sdpa_positional_and_keyword_arguments():
    q, k, v = make_qkv(2, 4, 2, 16, 16, 16, torch.float64, seed=3)
    ours = attention(q, k, v, None, 0.0, True, scale=0.2, enable_gqa=True)
    sdpa = F.scaled_dot_product_attention(q, k, v, None, 0.0, True, scale=0.2, enable_gqa=True)
    torch.testing.assert_close(ours, sdpa)
    ours = attention(query=q, key=k, value=v, is_causal=False, enable_gqa=True)
    sdpa = F.scaled_dot_product_attention(query=q, key=k, value=v, is_causal=False, enable_gqa=True)
    torch.testing.assert_close(ours, sdpa)


def test_attention_backward_is_bitwise_deterministic():
    q, k, v = make_qkv(1, 4, 1, 37, 37, 16, F16, seed=4)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE, F16)
    fn = lambda q, k, v: attention(q, k, v, is_causal=True, enable_gqa=True)
    _, first = run_attention(fn, q, k, v, do)
    first = [g.clone() for g in first]
    _, second = run_attention(fn, q, k, v, do)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_attention_backward_takes_a_non_contiguous_do():
    # The gradient reaching o through a transpose is itself a transposed, non-contiguous view.
    q, k, v = make_qkv(1, 2, 2, 16, 23, 16, seed=6)
    weight = torch.randn(1, 16, 2, 16, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    (attention(q, k, v).transpose(1, 2) * weight).sum().backward()
    do = weight.transpose(1, 2)
    assert not do.is_contiguous()
    _, grads_ref = float64_truth(q, k, v, do, False, "upper_left")
    for g, g_ref in zip((q.grad, k.grad, v.grad), grads_ref):
        torch.testing.assert_close(g.double(), g_ref, **TOL[F32])


def test_return_lse_gives_float32_lse_without_gradient():
    q, k, v = make_qkv(1, 2, 2, 16, 16, 16, F16, seed=8)
    o, lse = attention(q, k, v, is_causal=True, return_lse=True)
    _, lse_ref = attention_truth(q.double(), k.double(), v.double(), causal=True)
    assert lse.dtype == torch.float32 and lse.shape == (1, 2, 16) and not lse.requires_grad
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-4, rtol=1e-4)


def test_torch_compile_fullgraph_traces_forward_and_backward_on_the_reference_path():
    q, k, v = make_qkv(1, 4, 2, 21, 21, 16, seed=9)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    with use_backend("reference"):
        eager = run_attention(lambda q, k, v: attention(q, k, v, is_causal=True, enable_gqa=True), q, k, v, do)
        fn = lambda q, k, v: attention(q, k, v, is_causal=True, enable_gqa=True)
        compiled = run_attention(torch.compile(fn, fullgraph=True, backend="aot_eager"), q, k, v, do)
    torch.testing.assert_close(compiled[0], eager[0])
    for a, b in zip(compiled[1], eager[1]):
        torch.testing.assert_close(a, b)


def test_torch_compile_fullgraph_traces_the_default_dispatch():
    # No use_backend: the tier comes from the device, the dtype and TRITON_INTERPRET, read at trace
    # time. Reading Triton's knob is C code dynamo cannot trace; a graph break here failed fullgraph.
    q, k, v = make_qkv(1, 4, 2, 19, 19, 16, seed=20)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(21)).to(DEVICE)
    fn = lambda q, k, v: attention(q, k, v, is_causal=True, enable_gqa=True)
    eager = run_attention(fn, q, k, v, do)
    compiled = run_attention(torch.compile(fn, fullgraph=True, backend="aot_eager"), q, k, v, do)
    torch.testing.assert_close(compiled[0], eager[0])
    for a, b in zip(compiled[1], eager[1]):
        torch.testing.assert_close(a, b)


def compiled_graphs(fn, *inputs) -> list:
    """The FX graphs torch.compile(fn, fullgraph=True) hands its backend for these inputs."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, fullgraph=True, backend=capture)(*inputs)
    return graphs


def test_torch_compile_graph_holds_the_custom_ops_as_single_nodes():
    q, k, v = make_qkv(1, 2, 2, 16, 16, 16, seed=11)
    with use_backend("reference"):
        graphs = compiled_graphs(lambda q, k, v: attention(q, k, v, is_causal=True), q, k, v)
    (graph,) = graphs  # fullgraph: exactly one graph, no break
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert "flashtile.attention_fwd.default" in targets


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_eager_calls_skip_the_custom_op_and_match_it_bit_for_bit(backend, monkeypatch):
    q, k, v = make_qkv(1, 4, 2, 23, 29, 16, seed=14)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(15)).to(DEVICE)
    o_op, lse_op, stats_op = attention_fwd(q, k, v, 0.3, "lower_right", -1, 0, None, backend)  # causal: (-1, 0)
    grads_op = torch.autograd.grad(o_op, (q, k, v), do)

    def refuse(*args):
        raise AssertionError("an eager call went through the custom op")

    monkeypatch.setattr(flashtile._dispatch.dense, "attention_fwd", refuse)
    with use_backend(backend):
        kwargs = dict(is_causal=True, scale=0.3, enable_gqa=True, alignment="lower_right")
        o, lse = attention(q, k, v, return_lse=True, **kwargs)
        grads = torch.autograd.grad(o, (q, k, v), do)
        o_no_grad = attention(q.detach(), k.detach(), v.detach(), **kwargs)
    assert torch.equal(o, o_op) and torch.equal(lse, lse_op) and torch.equal(o_no_grad, o_op)
    for ours, theirs in zip(grads, grads_op):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_custom_ops_pass_torch_library_opcheck(backend):
    q, k, v = make_qkv(1, 2, 1, 20, 20, 16, seed=12)
    args = (q, k, v, 0.25, "lower_right", -1, 0, None, backend)  # causal: the band (-1, 0)
    torch.library.opcheck(attention_fwd, args)
    o, lse, stats = attention_fwd(*args)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(13)).to(DEVICE)
    inputs = (t.detach() for t in (do, q, k, v, o, lse, stats))
    torch.library.opcheck(attention_bwd, (*inputs, *args[3:]))


def test_backward_op_passes_opcheck_with_a_gqa_split(monkeypatch):
    # On the GPU a small GQA grid splits each group's dK/dV work (kernels.backward.pick_kv_split); the CPU
    # never picks a split, so force one here. The op's outputs must not alias each other: a split that
    # returned dk and dv as two halves of one buffer failed under torch.compile on the GPU only.
    import flashtile.kernels.backward as backward

    monkeypatch.setattr(backward, "pick_kv_split", lambda group, programs, device: group)
    q, k, v = make_qkv(1, 4, 2, 21, 19, 16, seed=16)
    o, lse, stats = attention_fwd(q, k, v, 0.25, "upper_left", -1, 0, None, "triton")
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(17)).to(DEVICE)
    args = (do, *(t.detach() for t in (q, k, v, o, lse, stats)), 0.25, "upper_left", -1, 0, None, "triton")
    torch.library.opcheck(attention_bwd, args)
    _, expected = float64_truth(q, k, v, do, True, "upper_left")
    for name, ours, theirs in zip(("dq", "dk", "dv"), attention_bwd(*args), expected):
        torch.testing.assert_close(ours.double(), theirs, **TOL[F32], msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_gradients_of_bthd_views_keep_the_views_layout(backend):
    # q, k, v as a model passes them: (B, H, T, D) views of (B, T, H, D) projections. Each tier returns
    # gradients in that layout, so autograd stores them as they are; in any other layout autograd copies
    # each into the leaf's (which is why the leaves' .grad alone could not tell). The custom op's fake
    # implementation must say the same: opcheck compares it with the real one.
    gen = torch.Generator().manual_seed(19)
    q, k, v = (torch.randn(1, 23, h, 16, generator=gen).transpose(1, 2).to(DEVICE).requires_grad_() for h in (4, 2, 2))
    do = torch.randn(1, 4, 23, 16, generator=gen).to(DEVICE)
    o, lse, stats = attention_fwd(q, k, v, 0.25, "upper_left", -1, 0, None, backend)
    args = (do, *(t.detach() for t in (q, k, v, o, lse, stats)), 0.25, "upper_left", -1, 0, None, backend)
    grads = attention_bwd(*args)
    _, expected = float64_truth(q, k, v, do, True, "upper_left")
    for name, x, g, truth in zip(("dq", "dk", "dv"), (q, k, v), grads, expected):
        assert g.stride() == x.stride() == (23 * x.shape[1] * 16, 16, x.shape[1] * 16, 1), name
        torch.testing.assert_close(g.double(), truth, **TOL[F32], msg=lambda m, name=name: f"{name}: {m}")
    torch.library.opcheck(attention_bwd, args)


def _query_layouts(gen):
    """(name, q) with q (1, 4, 23, 16) in the layouts a caller may pass: dense ones in three orders and
    with an odd stride on the size-one batch dim, and two that are not dense (a slice, gaps between rows)."""
    base = torch.randn(1, 23, 4, 32, generator=gen)
    odd = torch.randn(2000, generator=gen).as_strided((1, 4, 23, 16), (999, 16, 80, 1))  # rows 80 apart: gaps
    heads_first = base[..., :16].transpose(1, 2)
    return [
        ("bhtd", base[..., :16].transpose(1, 2).contiguous()),
        ("bthd view", base[..., :16].contiguous().transpose(1, 2)),
        ("tbhd view", base[..., :16].permute(1, 0, 2, 3).contiguous().permute(1, 2, 0, 3)),
        ("one batch, odd stride", torch.empty_strided((1, 4, 23, 16), (7, 368, 16, 1)).copy_(heads_first)),
        ("head dim sliced", base.transpose(1, 2)[..., :16]),
        ("row gaps", odd),
    ]


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_output_is_laid_out_like_a_dense_query_on_every_tier(backend):
    # A model's query is a (B, H, T, D) view of a (B, T, H, D) projection; o in that layout makes the
    # model's transpose back free. Where q is not dense o is contiguous. Both tiers and the custom op's
    # fake implementation must agree (opcheck compares the fake's strides with the real ones).
    from flashtile._layouts import contiguous_strides, strides_like

    gen = torch.Generator().manual_seed(23)
    k, v = (torch.randn(1, 2, 23, 16, generator=gen).to(DEVICE) for _ in range(2))
    for name, q in _query_layouts(gen):
        q = q.to(DEVICE) if DEVICE == "cpu" else torch.empty_strided(q.shape, q.stride(), device=DEVICE).copy_(q)
        dense = name not in ("head dim sliced", "row gaps")
        expected = q.stride() if dense else contiguous_strides(q.shape)
        assert strides_like(q) == tuple(expected), name
        with use_backend(backend):
            o = attention(q, k, v, is_causal=True, enable_gqa=True)
        assert o.stride() == tuple(expected), (name, o.stride())
        o_ref, _ = attention_truth(q.double(), k.double(), v.double(), causal=True)
        torch.testing.assert_close(o.double(), o_ref, **TOL[F32], msg=lambda m, name=name: f"{name}: {m}")
        torch.library.opcheck(attention_fwd, (q, k, v, 0.25, "upper_left", -1, 0, None, backend))


def test_dispatch_picks_the_tier_from_device_dtype_and_override():
    q = torch.zeros(1, 1, 1, 16, device=DEVICE)
    assert pick_backend(q) == "triton"  # CUDA, or the CPU with TRITON_INTERPRET=1 (set by conftest)
    assert pick_backend(q.double()) == "reference"
    with use_backend("reference"):
        assert pick_backend(q) == "reference"
    assert pick_backend(q) == "triton"


def test_attention_is_exported_at_the_top_level():
    assert flashtile.attention is attention


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(attn_mask=torch.ones(16, 16, dtype=torch.bool)), ValueError, "attn_mask is not supported"),
        (dict(dropout_p=0.1), ValueError, "dropout_p must be 0.0"),
        (dict(kv_heads=1), ValueError, "pass enable_gqa=True"),
        (dict(kv_heads=3, enable_gqa=True), ValueError, "multiple of the number of key/value heads"),
        (dict(alignment="center"), ValueError, "alignment must be one of"),
        (dict(is_causal=1), TypeError, "is_causal must be a bool"),
        (dict(scale=float("nan")), ValueError, "scale must be finite"),
        (dict(rank3=True), ValueError, "query must be a rank-4 tensor"),
        (dict(value_dtype=torch.float16), TypeError, "value has dtype torch.float16 but query"),
    ],
)
def test_attention_rejects_bad_input_with_a_clear_message(kwargs, error, match):
    kv_heads = kwargs.pop("kv_heads", 2)
    q, k, v = (t.detach() for t in make_qkv(1, 2, kv_heads, 16, 16, 16))
    if kwargs.pop("rank3", False):
        q = q[0]
    if "value_dtype" in kwargs:
        v = v.to(kwargs.pop("value_dtype"))
    with pytest.raises(error, match=match):
        attention(q, k, v, **kwargs)


def test_use_backend_rejects_unknown_names():
    with pytest.raises(ValueError, match="backend must be one of"):
        with use_backend("cuda"):
            pass


# --- the eager fast path: checks kept per layout, the kernel's plan kept per call ------------------------


@pytest.mark.parametrize(
    ("changed", "error"),
    [(dict(is_causal=1), TypeError), (dict(scale=float("inf")), ValueError), (dict(alignment="left"), ValueError),
     (dict(return_lse="no"), TypeError), (dict(enable_gqa=False), ValueError)],
)  # fmt: skip
def test_a_kept_call_does_not_let_a_bad_flag_through(changed, error):
    q, k, v = (t.detach() for t in make_qkv(1, 4, 2, 21, 33, 16, seed=31))
    good = dict(is_causal=True, scale=0.2, enable_gqa=True, alignment="lower_right", return_lse=True)
    attention(q, k, v, **good)  # its checks and its kernel plan are kept now
    with pytest.raises(error):
        attention(q, k, v, **{**good, **changed})


def test_kept_calls_give_new_inputs_of_one_layout_their_own_answers():
    for seed in (32, 33, 34):  # one layout, new values and addresses: the kept plan is reused, the data is not
        q, k, v = (t.detach() for t in make_qkv(2, 2, 1, 19, 27, 8, seed=seed))
        o, lse = attention(q, k, v, is_causal=True, enable_gqa=True, alignment="lower_right", return_lse=True)
        o_truth, lse_truth = attention_truth(q.double(), k.double(), v.double(), causal=True, alignment="lower_right")
        torch.testing.assert_close(o.double(), o_truth, **TOL[F32])
        torch.testing.assert_close(lse.double(), lse_truth, **TOL[F32])


def test_recorded_calls_reuse_the_kept_kernel_plan_and_still_train(monkeypatch):
    """With inputs that require gradients, an eager call takes the kept kernel plan too, not the launcher
    (whose own plan lookup costs a few µs a call): the launcher is never entered, make_forward_plan runs
    at most once for the layout, and every call's output and gradients still match the float64 truth."""
    import flashtile.kernels.forward as forward

    if pick_backend(torch.empty(1, device=DEVICE)) != "triton":
        pytest.skip("the reference tier runs here: no kernel plan to keep")
    made, launched = [], []
    real_plan, real_launcher = forward.make_forward_plan, forward.flash_attention
    monkeypatch.setattr(forward, "make_forward_plan", lambda *a, **kw: made.append(1) or real_plan(*a, **kw))
    monkeypatch.setattr(forward, "flash_attention", lambda *a, **kw: launched.append(1) or real_launcher(*a, **kw))
    for seed in (41, 42, 43):  # one layout, three sets of values
        q, k, v = make_qkv(1, 4, 2, 23, 37, 16, seed=seed)
        do = torch.randn_like(q)
        o, grads = run_attention(lambda a, b, c: attention(a, b, c, is_causal=True, enable_gqa=True), q, k, v, do)
        o_truth, grads_truth = float64_truth(q, k, v, do, True, "upper_left")
        torch.testing.assert_close(o.double(), o_truth, **TOL[F32])
        for g, g_truth in zip(grads, grads_truth):
            torch.testing.assert_close(g.double(), g_truth, **TOL[F32])
    assert len(made) <= 1 and not launched  # made once (or kept from an earlier test), then reused


def test_an_eager_backward_fills_no_zero_gradients_for_lse_and_stats():
    """lse and (m, l) are outputs that never get a gradient; the engine must not build zero tensors for
    them before each backward (it does unless the function turns that off). Every aten op of the
    gradient computation is recorded, and none may allocate zeros or fill."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    q, k, v = make_qkv(1, 2, 2, 19, 19, 16, seed=51)
    do = torch.randn_like(q)
    o = attention(q, k, v, is_causal=True)
    with Ops() as ops:
        grads = torch.autograd.grad(o, (q, k, v), do)
    assert ops.names, "the mode saw no op: it would pass whatever the backward did"
    assert not [n for n in ops.names if n.split(".")[-1] in ("zeros", "zeros_like", "new_zeros", "fill_", "zero_")]
    o_truth, grads_truth = float64_truth(q, k, v, do, True, "upper_left")
    for g, g_truth in zip(grads, grads_truth):
        torch.testing.assert_close(g.double(), g_truth, **TOL[q.dtype])



# --- window= and softcap= (issue 36): the same answer and the same refusals on every tier ------------------


def windowed_truth(q, k, v, do, window, causal, alignment, softcap):
    """o and (dq, dk, dv) in float64 through the mask built from the window's definition (``_truth``)."""
    keep = definition_mask(q.shape[2], k.shape[2], window, causal, alignment).to(q.device)
    q64, k64, v64, do64 = (t.detach().double() for t in (q, k, v, do))
    o, _lse = masked_truth(q64, k64, v64, keep, None, softcap)
    return o, truth_gradients(q64, k64, v64, do64, keep, None, softcap)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize(("window", "causal", "alignment", "softcap"),
                         [((6, 2), False, "lower_right", 2.0), ((9, -1), True, "upper_left", None)])  # fmt: skip
def test_window_and_softcap_match_float64_through_autograd_on_every_tier(backend, window, causal, alignment, softcap):
    q, k, v = make_qkv(1, 4, 2, 37, 29, 16, seed=41)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(42)).to(DEVICE)
    with use_backend(backend):
        fn = lambda q, k, v: attention(q, k, v, is_causal=causal, enable_gqa=True, alignment=alignment,
                                       window=window, softcap=softcap)  # fmt: skip
        o, grads = run_attention(fn, q, k, v, do)
    o_ref, grads_ref = windowed_truth(q, k, v, do, window, causal, alignment, softcap)
    torch.testing.assert_close(o.double(), o_ref, **TOL[F32])
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        torch.testing.assert_close(g.double(), g_ref, **TOL[F32], msg=lambda m, name=name: f"{name}: {m}")


def test_torch_compile_carries_window_and_softcap_into_the_ops():
    q, k, v = make_qkv(1, 2, 2, 21, 21, 16, seed=43)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(44)).to(DEVICE)
    fn = lambda q, k, v: attention(q, k, v, is_causal=True, window=(4, -1), softcap=1.5)
    eager = run_attention(fn, q, k, v, do)
    compiled = run_attention(torch.compile(fn, fullgraph=True, backend="aot_eager"), q, k, v, do)
    torch.testing.assert_close(compiled[0], eager[0])
    for a, b in zip(compiled[1], eager[1]):
        torch.testing.assert_close(a, b)
    graphs = compiled_graphs(fn, q, k, v)
    (call,) = [n for n in graphs[0].graph.nodes if str(n.target) == "flashtile.attention_fwd.default"]
    # the band's sides (causal caps the right one at 0) and the cap, in the op's schema
    assert tuple(call.args[4:8]) == ("upper_left", 4, 0, 1.5), call.args
    o_ref, _ = windowed_truth(q, k, v, do, (4, -1), True, "upper_left", 1.5)
    torch.testing.assert_close(compiled[0].double(), o_ref, **TOL[F32])


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_custom_ops_with_a_window_and_a_cap_pass_opcheck(backend):
    q, k, v = make_qkv(1, 2, 1, 20, 24, 16, seed=45)
    args = (q, k, v, 0.25, "lower_right", 5, 1, 3.0, backend)
    torch.library.opcheck(attention_fwd, args)
    o, lse, stats = attention_fwd(*args)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(46)).to(DEVICE)
    inputs = (t.detach() for t in (do, q, k, v, o, lse, stats))
    torch.library.opcheck(attention_bwd, (*inputs, *args[3:]))


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(window=[3]), TypeError, r"window must be None or a pair"),
        (dict(window=(3, -5)), ValueError, r"window\[1\] \(right\) must be -1"),
        (dict(window=(True, 0)), TypeError, r"window\[0\] \(left\) must be an int"),
        (dict(window=(2.0, 0)), TypeError, r"window\[0\] \(left\) must be an int"),
        (dict(softcap=-1.0), ValueError, "softcap must be a positive finite number"),
        (dict(softcap=float("nan")), ValueError, "softcap must be a positive finite number"),
        (dict(softcap=False), TypeError, "softcap must be a positive real number"),
    ],
)
def test_attention_refuses_bad_windows_and_caps_by_name_on_every_tier(backend, kwargs, error, match):
    q, k, v = (t.detach() for t in make_qkv(1, 2, 2, 16, 16, 16, seed=47))
    with use_backend(backend):
        attention(q, k, v, window=(1, 0), softcap=2.0)  # kept checks and plan of a valid call let nothing through
        with pytest.raises(error, match=match):
            attention(q, k, v, **kwargs)


def test_reference_attention_takes_the_window_and_the_cap_in_both_directions():
    from flashtile.reference.autograd import reference_attention

    q, k, v = make_qkv(1, 2, 2, 30, 26, 16, seed=48)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(49)).to(DEVICE)
    fn = lambda q, k, v: reference_attention(q, k, v, False, None, 8, 8, "lower_right", window=(5, 2), softcap=1.5)
    o, grads = run_attention(fn, q, k, v, do)
    o_ref, grads_ref = windowed_truth(q, k, v, do, (5, 2), False, "lower_right", 1.5)
    torch.testing.assert_close(o.double(), o_ref, **TOL[F32])
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        torch.testing.assert_close(g.double(), g_ref, **TOL[F32], msg=lambda m, name=name: f"{name}: {m}")


def test_torch_compile_traces_the_decode_route_into_its_op():
    # Tq <= 16 without a gradient runs the decode kernels (api.decode_route); compiled, the route is read at
    # trace time and the kernels sit behind one op, flashtile::attention_decode, with the eager answer
    q, k, v = (t.detach() for t in make_qkv(1, 4, 2, 3, 40, 16, seed=30))
    fn = lambda q, k, v: attention(q, k, v, is_causal=True, enable_gqa=True, alignment="lower_right", window=(9, 0))
    with torch.no_grad():
        eager = fn(q, k, v)
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)
        (graph,) = compiled_graphs(fn, q, k, v)
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    op = "attention_decode" if pick_backend(q) == "triton" else "attention_fwd"
    assert f"flashtile.{op}.default" in targets
    assert torch.equal(compiled, eager)


def test_the_decode_op_passes_opcheck():
    from flashtile.api import attention_decode

    q, k, v = (t.detach() for t in make_qkv(1, 4, 2, 2, 30, 16, seed=31))
    torch.library.opcheck(attention_decode, (q, k, v, 0.25, "lower_right", 4, 0, 2.0))  # a window (4, 0) and a cap


# --- the kept call (issue 35): a layout and flags seen before skip the checks, never what may change ---------


def fresh_plans(monkeypatch):
    """An empty plan table: the next call of any layout runs every check, as in a new process."""
    from flashtile import _plans

    monkeypatch.setattr(_plans, "_plans", {})


def outcome(fn):
    """fn()'s tensors (detached), or its error's type and message."""
    try:
        out = fn()
    except Exception as error:  # noqa: BLE001 - the error itself is the outcome compared
        return type(error), str(error)
    return tuple(t.detach() for t in (out if isinstance(out, tuple) else (out,)))


def same_outcome(a, b) -> bool:
    if isinstance(a[0], type) or isinstance(b[0], type):
        return a == b
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("mode", ["grad", "no_grad", "reference", "neg_bit", "autocast", "forward_ad", "vmap"])
def test_a_kept_call_gives_what_a_first_call_gives_whatever_changed_since(mode, monkeypatch):
    """attention's fast path finds the checked call by its key and reads again only what may change between
    two calls of one key: whether autograd records, the forced tier, a negative bit, autocast, forward-mode
    AD, torch.func. Each state runs on an empty plan table (every check runs) and again after a plain call
    of the same layout and flags kept its call and kernel plan: the same answer, or the same error."""
    q, k, v = make_qkv(1, 4, 2, 19, 21, 16, seed=60)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(61)).to(DEVICE)
    kwargs = dict(is_causal=True, enable_gqa=True, alignment="lower_right", return_lse=True)

    def call():
        if mode == "grad":  # o, lse and the three gradients through the kept backward plan
            o, lse = attention(q, k, v, **kwargs)
            return (o, lse, *torch.autograd.grad(o, (q, k, v), do))
        if mode == "no_grad":
            with torch.no_grad():
                return attention(q, k, v, **kwargs)
        if mode == "reference":
            with use_backend("reference"):
                return attention(q.detach(), k.detach(), v.detach(), **kwargs)
        if mode == "neg_bit":  # a view with the negative bit, holding q's values, in q's own layout
            return attention(torch._neg_view(-q.detach()), k.detach(), v.detach(), **kwargs)
        if mode == "autocast":
            with torch.autocast(DEVICE, dtype=torch.float16 if DEVICE == "cuda" else torch.bfloat16):
                return attention(q.detach(), k.detach(), v.detach(), **kwargs)
        if mode == "forward_ad":
            import torch.autograd.forward_ad as fwAD

            with fwAD.dual_level():
                return attention(fwAD.make_dual(q.detach(), torch.ones_like(q)), k.detach(), v.detach(), **kwargs)
        fn = lambda x: attention(x, k.detach(), v.detach(), **kwargs)[0]  # noqa: E731
        return torch.func.vmap(fn)(q.detach().unsqueeze(0).expand(2, *q.shape))

    fresh_plans(monkeypatch)
    first = outcome(call)
    fresh_plans(monkeypatch)
    attention(q.detach(), k.detach(), v.detach(), **kwargs)  # keeps the call and its kernel plan
    attention(q, k, v, **kwargs)[0].backward(do)  # and a backward plan
    again = outcome(call)
    if mode in ("forward_ad", "vmap"):
        assert first[0] is NotImplementedError, first
    else:
        assert not isinstance(first[0], type), first
    assert same_outcome(first, again), (first, again)
    if mode == "neg_bit":
        assert same_outcome(first, outcome(lambda: attention(q.detach(), k.detach(), v.detach(), **kwargs)))
    if mode == "autocast":
        assert first[0].dtype == (torch.float16 if DEVICE == "cuda" else torch.bfloat16)


def test_the_eager_backward_keeps_one_plan_per_layout_of_do_and_every_gradient_is_right(monkeypatch):
    """A call run from its kept forward plan keeps its backward plans by do's layout alone (q, k, v are the
    call's, o and the row statistics the forward's fresh outputs): a new layout of do makes a plan, a seen
    one reuses it, and every gradient matches the float64 truth."""
    import flashtile.kernels.backward as backward

    if pick_backend(torch.empty(1, device=DEVICE)) != "triton":
        pytest.skip("the reference tier runs here: no kernel plan to keep")
    fresh_plans(monkeypatch)
    made = []
    real_plan = backward.make_backward_plan
    monkeypatch.setattr(backward, "make_backward_plan", lambda *a, **kw: made.append(1) or real_plan(*a, **kw))
    q, k, v = make_qkv(1, 4, 2, 23, 37, 16, seed=62)
    gen = torch.Generator().manual_seed(63)
    layouts = []
    for layout in ("contiguous", "contiguous", "bthd", "negative", "bthd"):
        do = torch.randn(q.shape, generator=gen).to(DEVICE)
        if layout == "bthd":  # a (B, H, T, D) view of (B, T, H, D) memory
            do = do.transpose(1, 2).contiguous().transpose(1, 2)
        if layout == "negative":  # resolved to a contiguous copy: the contiguous layout's plan
            do = torch._neg_view(-do)
        o, grads = run_attention(lambda a, b, c: attention(a, b, c, is_causal=True, enable_gqa=True), q, k, v, do)
        o_truth, grads_truth = float64_truth(q, k, v, do.resolve_neg(), True, "upper_left")
        torch.testing.assert_close(o.double(), o_truth, **TOL[F32])
        for name, g, g_truth in zip(("dq", "dk", "dv"), grads, grads_truth):
            torch.testing.assert_close(g.double(), g_truth, **TOL[F32], msg=lambda m, name=name: f"{name}: {m}")
        layouts.append(len(made))
    assert layouts == [1, 1, 2, 2, 2], layouts


def test_a_kept_call_refuses_new_tensors_that_differ_in_one_thing():
    q, k, v = (t.detach() for t in make_qkv(1, 4, 2, 21, 33, 16, seed=64))
    attention(q, k, v, enable_gqa=True)  # kept now
    with pytest.raises(TypeError, match="dtype"):
        attention(q, k.double(), v, enable_gqa=True)
    with pytest.raises(ValueError, match="head dim"):
        attention(q, k[..., :8], v[..., :8], enable_gqa=True)
    with pytest.raises(TypeError, match="torch.Tensor"):
        attention(q, k.tolist(), v, enable_gqa=True)
    with pytest.raises(ValueError, match="enable_gqa"):
        attention(q, k, v)
    with pytest.raises(ValueError, match="dropout_p"):
        attention(q, k, v, dropout_p=0.1, enable_gqa=True)
    with pytest.raises(ValueError, match="attn_mask"):
        attention(q, k, v, attn_mask=torch.ones(21, 33, dtype=torch.bool), enable_gqa=True)
