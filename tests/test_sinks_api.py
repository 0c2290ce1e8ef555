"""Attention sinks through ``flashtile.attention``: both tiers against the dense float64 softmax with one extra
column (``tests/reference/_sink_truth.py``), and one error per bad input on every tier. The Triton tier runs in
the interpreter on the CPU, in float32 (its bfloat16 is wrong there)."""

import math

import pytest
import torch

import flashtile._dispatch.dense as dense
from flashtile.api import attention, attention_bwd, attention_fwd, use_backend
from flashtile.varlen import attention_varlen as flashtile_varlen
from tests._grids import covering
from tests.reference._sink_truth import dense_attention

SINK_TIERS = ["reference", "triton"]


def make_inputs(B, H, H_kv, Tq, Tk, D, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=gen, dtype=dtype) for shape in
               ((B, H, Tq, D), (B, H_kv, Tk, D), (B, H_kv, Tk, D)))  # fmt: skip
    sinks = 2 * torch.randn(H, generator=gen, dtype=dtype)
    do = torch.randn(B, H, Tq, D, generator=gen, dtype=dtype)
    return q, k, v, sinks, do


def truth(q, k, v, sinks, do, **mask):
    """The dense formula's o, lse and float64 autograd gradients for q, k, v and the sinks."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    o, lse = dense_attention(*leaves[:3], sinks=leaves[3], **mask)
    return o.detach(), lse.detach(), torch.autograd.grad(o, leaves, do.double())


def ours(q, k, v, sinks, do, backend, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    with use_backend(backend):
        o, lse = attention(*leaves[:3], sinks=leaves[3], return_lse=True, enable_gqa=True, **kwargs)
    return o.detach(), lse, torch.autograd.grad(o, leaves, do)


MASKS = {  # name: (flashtile.attention's keywords, the truth's)
    "none": (dict(), dict()),
    "causal-lower-right": (dict(is_causal=True, alignment="lower_right"), dict(causal=True, alignment="lower_right")),
    "window": (dict(window=(3, 1)), dict(window=(3, 1))),
    "causal-window": (dict(is_causal=True, window=(2, -1)), dict(causal=True, window=(2, -1))),
}


TIERS = {  # (backend, dtype): float64 always runs on the reference tier
    "reference-f64": ("reference", torch.float64),
    "reference-f32": ("reference", torch.float32),
    "triton-f32": ("triton", torch.float32),
}


@pytest.mark.parametrize(
    "backend, dtype, kwargs, truth_mask, H, H_kv, softcap, scale",
    covering(tier=TIERS, mask=MASKS, groups={"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)},
             softcap={"nocap": None, "cap": 1.5}, scale={"default": None, "negative": -0.6}),
)  # fmt: skip
def test_sinks_match_the_dense_softmax_with_a_sink_column_forward_and_backward(backend, dtype, kwargs, truth_mask, H,
                                                                                H_kv, softcap, scale):  # fmt: skip
    # Tq = 19 > 16 rows: the forward kernel, not the decode route; Tk = 13 is no multiple of a key tile
    q, k, v, sinks, do = make_inputs(2, H, H_kv, 19, 13, 8, dtype=dtype, seed=H + H_kv)
    kwargs, truth_mask = {**kwargs, "scale": scale}, {**truth_mask, "scale": scale}
    o, lse, grads = ours(q, k, v, sinks, do, backend, softcap=softcap, **kwargs)
    o_ref, lse_ref, grads_ref = truth(q, k, v, sinks, do, softcap=softcap, **truth_mask)
    tol = dict(rtol=0, atol=1e-12) if dtype == torch.float64 else dict(rtol=0, atol=2e-5)
    torch.testing.assert_close(o.double(), o_ref, **tol)
    torch.testing.assert_close(lse.double(), lse_ref, **tol)
    for name, g, g_ref in zip(("dq", "dk", "dv", "dsinks"), grads, grads_ref):
        assert g.dtype == dtype, name
        torch.testing.assert_close(g.double(), g_ref, rtol=0, atol=tol["atol"] * 10, msg=name)


def test_the_sink_changes_o_lse_and_every_gradient_so_the_test_above_can_fail():
    q, k, v, sinks, do = make_inputs(1, 2, 2, 6, 6, 4, seed=3)
    with_sink = truth(q, k, v, sinks, do)
    without = truth(q, k, v, torch.full_like(sinks, -math.inf), do)
    assert (with_sink[0] - without[0]).abs().max() > 1e-3 and (with_sink[1] - without[1]).abs().max() > 1e-3
    for g, g_none in zip(with_sink[2][:3], without[2][:3]):
        assert (g - g_none).abs().max() > 1e-3


@pytest.mark.parametrize("backend", SINK_TIERS)
def test_a_row_that_sees_no_key_gets_o_zero_lse_the_sink_and_a_sink_gradient_of_zero(backend):
    # lower-right causal with Tq > Tk: the first Tq - Tk rows see no key
    q, k, v, sinks, do = make_inputs(1, 2, 1, 20, 4, 8, dtype=torch.float32, seed=5)
    o, lse, grads = ours(q, k, v, sinks, do, backend, is_causal=True, alignment="lower_right")
    assert torch.equal(o[:, :, :16], torch.zeros_like(o[:, :, :16]))
    # lse = the sink: exactly on the reference tier, within float32's rounding of sink / |τ| in the kernel
    torch.testing.assert_close(lse[:, :, :16], sinks[None, :, None].expand(1, 2, 16), rtol=1e-6, atol=0)
    assert torch.equal(grads[0][:, :, :16], torch.zeros_like(grads[0][:, :, :16]))
    only_empty = do.clone()
    only_empty[:, :, 16:] = 0  # the gradient from the empty rows alone: D = 0 there, so dsinks = 0
    assert torch.equal(ours(q, k, v, sinks, only_empty, backend, is_causal=True, alignment="lower_right")[2][3],
                       torch.zeros_like(sinks))  # fmt: skip
    _, lse_ref, grads_ref = truth(q, k, v, sinks, do, causal=True, alignment="lower_right")
    torch.testing.assert_close(lse.double(), lse_ref, rtol=0, atol=2e-5)
    torch.testing.assert_close(grads[3].double(), grads_ref[3], rtol=0, atol=2e-4)


@pytest.mark.parametrize("backend", SINK_TIERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_sink_of_minus_inf_is_no_sink_bit_for_bit(backend, dtype):
    q, k, v, sinks, do = make_inputs(1, 4, 2, 10, 12, 8, dtype=dtype, seed=7)
    sinks = torch.full_like(sinks, -math.inf)
    o, lse, grads = ours(q, k, v, sinks, do, backend, is_causal=True, softcap=2.0)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with use_backend(backend):
        o_none, lse_none = attention(*leaves, return_lse=True, enable_gqa=True, is_causal=True, softcap=2.0)
    assert torch.equal(o, o_none) and torch.equal(lse, lse_none)
    for g, g_none in zip(grads, torch.autograd.grad(o_none, leaves, do)):
        assert torch.equal(g, g_none)
    assert torch.equal(grads[3], torch.zeros_like(sinks))


@pytest.mark.parametrize("backend", SINK_TIERS)
def test_sinks_gradient_passes_gradcheck_through_flashtile_attention(backend):
    q, k, v, sinks, _ = make_inputs(1, 2, 1, 5, 7, 4, seed=9)
    leaves = [t.requires_grad_() for t in (q, k, v, sinks)]

    def call(q, k, v, s):
        with use_backend(backend):
            return attention(q, k, v, is_causal=True, alignment="lower_right", window=(3, 0), softcap=1.5,
                             enable_gqa=True, sinks=s)  # fmt: skip

    assert torch.autograd.gradcheck(call, leaves)


@pytest.mark.parametrize("backend", SINK_TIERS)
def test_sinks_alone_requiring_a_gradient_get_one(backend):
    q, k, v, sinks, do = make_inputs(1, 2, 2, 6, 6, 4, seed=10)
    sinks.requires_grad_()
    with use_backend(backend):
        o = attention(q, k, v, sinks=sinks)
    (dsinks,) = torch.autograd.grad(o, sinks, do)
    torch.testing.assert_close(dsinks, truth(q, k, v, sinks, do)[2][3], rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", SINK_TIERS)
def test_torch_compile_fullgraph_with_sinks_matches_eager_with_its_gradients(backend):
    q, k, v, sinks, do = make_inputs(1, 4, 2, 9, 9, 8, dtype=torch.float32, seed=11)
    torch._dynamo.reset()  # the tier is read at trace time: no graph traced under the other tier
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def call(q, k, v, s):
        return attention(q, k, v, is_causal=True, enable_gqa=True, window=(4, -1), sinks=s, return_lse=True)

    with use_backend(backend):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
        o, lse = torch.compile(call, fullgraph=True, backend="aot_eager")(*leaves)
        grads = torch.autograd.grad(o, leaves, do)
        torch.compile(call, fullgraph=True, backend=capture)(q, k, v, sinks)
        eager_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
        o_eager, lse_eager = call(*eager_leaves)
        grads_eager = torch.autograd.grad(o_eager, eager_leaves, do)
    (graph,) = graphs
    # without a gradient, nine query rows take the decode op on the Triton tier (``decode_route``), the
    # forward op on the reference tier; either way the sinks are the op's last argument
    op, n_args = ("attention_decode", 9) if backend == "triton" else ("attention_fwd", 10)
    nodes = [n for n in graph.graph.nodes if str(n.target) == f"flashtile.{op}.default"]
    assert len(nodes) == 1 and len(nodes[0].args) == n_args and nodes[0].args[-1] is not None
    assert torch.equal(o, o_eager) and torch.equal(lse, lse_eager)
    for g, g_eager in zip(grads, grads_eager):
        assert torch.equal(g, g_eager)
    o_ref, _, grads_ref = truth(q, k, v, sinks, do, causal=True, window=(4, -1))
    torch.testing.assert_close(o.double(), o_ref, rtol=0, atol=2e-5)
    torch.testing.assert_close(grads[3].double(), grads_ref[3], rtol=0, atol=2e-4)


@pytest.mark.parametrize("backend", SINK_TIERS)
def test_the_ops_with_sinks_pass_torch_library_opcheck(backend):
    q, k, v, sinks, do = make_inputs(1, 2, 1, 7, 9, 8, dtype=torch.float32, seed=12)
    args = (q, k, v, 0.3, "lower_right", -1, 0, None, backend, sinks)
    torch.library.opcheck(attention_fwd, args)
    o, lse, stats = attention_fwd(*args)
    torch.library.opcheck(attention_bwd, (do, q, k, v, o, lse, stats, *args[3:]))
    dq, dk, dv, dsinks = attention_bwd(do, q, k, v, o, lse, stats, *args[3:])
    assert dsinks.shape == (2,) and dsinks.dtype == sinks.dtype
    assert attention_bwd(do, q, k, v, o, lse, stats, *args[3:-1])[3].numel() == 0  # no sinks: an empty dsinks


@pytest.mark.parametrize("backend, dtype", [("reference", torch.float64), ("triton", torch.float32)])
def test_a_kept_call_reads_the_sinks_values_every_call(monkeypatch, backend, dtype):
    q, k, v, sinks, _ = make_inputs(1, 2, 2, 5, 5, 4, dtype=dtype, seed=13)
    checks = []
    real = dense.check_attention_call
    monkeypatch.setattr("flashtile.api.check_attention_call", lambda *a, **kw: checks.append(1) or real(*a, **kw))
    atol = 1e-12 if dtype == torch.float64 else 2e-6
    with use_backend(backend):
        first = attention(q, k, v, sinks=sinks)
        second = attention(q, k, v, sinks=sinks - 3)  # the same layout: the kept call, new values
        assert len(checks) == 1
        q64, k64, v64 = q.double(), k.double(), v.double()  # Tq = 5: the decode route's length, which sinks skip
        torch.testing.assert_close(second.double(), dense_attention(q64, k64, v64, sinks=sinks - 3)[0], rtol=0,
                                   atol=atol)  # fmt: skip
        assert not torch.equal(first, second)
        with pytest.raises(ValueError, match=r"sinks must be finite or -inf"):
            attention(q, k, v, sinks=torch.tensor([0.0, math.nan], dtype=dtype))
        no_sinks = attention(q, k, v)  # a call without sinks is another key, never the kept call with them
    assert len(checks) == 2
    torch.testing.assert_close(no_sinks.double(), dense_attention(q64, k64, v64)[0], rtol=0, atol=atol)


BAD_SINKS = [  # (id, sinks for float32 inputs with H = 2, error, message)
    ("list", [0.0, 1.0], TypeError, r"sinks must be a torch.Tensor, got list"),
    ("rank-2", torch.zeros(1, 2), ValueError, r"sinks must be a rank-1 tensor"),
    ("per-kv-head", torch.zeros(1), ValueError, r"sinks must have shape \(H,\) = \(2,\)"),
    ("int", torch.zeros(2, dtype=torch.int64), TypeError, r"sinks must have dtype in \(float32\)"),
    ("float64", torch.zeros(2, dtype=torch.float64), TypeError, r"sinks must have dtype in \(float32\)"),
    ("nan", torch.tensor([math.nan, 0.0]), ValueError, r"sinks must be finite or -inf"),
    ("plus-inf", torch.tensor([0.0, math.inf]), ValueError, r"sinks must be finite or -inf"),
    ("meta", torch.zeros(2, device="meta"), ValueError, r"sinks is on meta but q is on cpu"),
    ("sparse", torch.zeros(2).to_sparse(), TypeError, r"sinks must be a dense \(strided\) tensor"),
    # past what the kernels' float32 start state holds: sink / |scale| (scale 8^-0.5) within float32's range
    ("past-float32", torch.tensor([0.0, 2e38]), ValueError, r"sinks must be at most 6\.015e\+37 in magnitude"),
]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("name, sinks, error, message", BAD_SINKS, ids=[c[0] for c in BAD_SINKS])
def test_bad_sinks_get_the_same_error_on_every_tier(backend, name, sinks, error, message):
    q, k, v, _, _ = make_inputs(1, 2, 1, 4, 4, 8, dtype=torch.float32, seed=14)
    with use_backend(backend), pytest.raises(error, match=message):
        attention(q, k, v, sinks=sinks, enable_gqa=True)


def test_large_finite_sinks_match_the_float64_formula_on_every_tier():
    """A sink past 2^31 (where the kernels' fast start state rounds its shift by more than float32's range
    and restarts on the exact path) and one near the limit: o, lse and every gradient as the float64
    formula gives them, on the forward kernel (18 rows, with a gradient) and the decode kernels (3 rows,
    none); a sink of -1e30 is as good as none."""
    for Tq in (18, 3):
        q, k, v, _, do = make_inputs(1, 4, 2, Tq, 9, 8, dtype=torch.float32, seed=30 + Tq)
        sinks = torch.tensor([5e9, 1e20, 1e37, -1e30])
        o_ref, lse_ref, grads_ref = truth(q, k, v, sinks, do, causal=True, alignment="lower_right")
        assert torch.isfinite(lse_ref).all() and (lse_ref[:, :3] > 1e9).all()
        for backend in SINK_TIERS:
            if Tq == 3:  # no gradient: the decode kernels on the Triton tier
                with use_backend(backend):
                    o, lse = attention(q, k, v, sinks=sinks, is_causal=True, alignment="lower_right",
                                       enable_gqa=True, return_lse=True)  # fmt: skip
                grads = grads_ref
            else:
                o, lse, grads = ours(q, k, v, sinks, do, backend, is_causal=True, alignment="lower_right")
            torch.testing.assert_close(o.double(), o_ref, rtol=0, atol=2e-6)
            torch.testing.assert_close(lse.double(), lse_ref, rtol=1e-6, atol=2e-6)
            for g, g_ref in zip(grads, grads_ref):
                torch.testing.assert_close(g.double(), g_ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("backend", SINK_TIERS)
def test_the_sink_limit_follows_the_scale_and_the_softcap(backend):
    """Without a softcap the kernels hold sink / |scale| in float32: a tiny scale lowers the limit, on both
    tiers alike; a softcap lifts it (the capped loop runs in natural units); float64 inputs have none."""
    q, k, v, _, _ = make_inputs(1, 2, 2, 4, 6, 8, dtype=torch.float32, seed=16)
    sinks = torch.tensor([40.0, -100.0])
    with use_backend(backend):
        with pytest.raises(ValueError, match=r"sinks must be at most 1\.701e\+01 in magnitude for this call, got "
                                             r"1\.000e\+02"):  # fmt: skip
            attention(q, k, v, sinks=sinks, scale=1e-37)
        o, lse = attention(q, k, v, sinks=sinks, scale=1e-37, softcap=5.0, return_lse=True)
    o_ref, lse_ref = dense_attention(q.double(), k.double(), v.double(), sinks=sinks.double(), scale=1e-37,
                                     softcap=5.0)  # fmt: skip
    torch.testing.assert_close(lse.double(), lse_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(o.double(), o_ref, rtol=0, atol=2e-6)
    o64, _ = attention(q.double(), k.double(), v.double(), sinks=sinks.double(), scale=1e-37, return_lse=True)
    torch.testing.assert_close(o64, dense_attention(q.double(), k.double(), v.double(), sinks=sinks.double(),
                                                    scale=1e-37)[0], rtol=0, atol=1e-12)  # fmt: skip


def test_a_sink_limit_is_checked_against_every_call_of_one_tensor():
    """The largest |sink| is kept per tensor until it is written to; each call compares it with its own
    limit, so a tensor that passed a call with scale 1 is refused by one with a tiny scale."""
    q, k, v, _, _ = make_inputs(1, 2, 2, 4, 6, 8, dtype=torch.float32, seed=17)
    sinks = torch.tensor([40.0, 1.0])
    with use_backend("reference"):
        attention(q, k, v, sinks=sinks)
        with pytest.raises(ValueError, match=r"sinks must be at most"):
            attention(q, k, v, sinks=sinks, scale=1e-37)
        attention(q, k, v, sinks=sinks)  # and the first call's layout still passes


def test_meta_sinks_with_meta_inputs_give_meta_outputs():
    """Meta tensors hold no values: nothing is read, and the outputs are meta tensors of the right shapes."""
    q, k, v = (torch.empty(1, 2, t, d, device="meta") for t, d in ((4, 8), (6, 8), (6, 5)))
    o, lse = attention(q, k, v, sinks=torch.empty(2, device="meta"), return_lse=True)
    assert o.is_meta and o.shape == (1, 2, 4, 5) and lse.shape == (1, 2, 4)


def test_a_negative_view_of_sinks_is_read_as_its_values():
    q, k, v, sinks, _ = make_inputs(1, 2, 2, 5, 5, 4, seed=15)
    view = torch.complex(torch.zeros_like(sinks), -sinks).conj().imag  # holds -(-sinks) in a negative view
    assert view.is_neg()
    with use_backend("reference"):
        torch.testing.assert_close(attention(q, k, v, sinks=view), dense_attention(q, k, v, sinks=sinks)[0],
                                   rtol=0, atol=1e-12)  # fmt: skip


def test_the_triton_tier_runs_the_forward_kernel_with_its_sink_start_state(monkeypatch):
    """The Triton answer comes from the kernel (its plan says SINK), not from a fallback to the reference."""
    import flashtile.kernels.forward as forward

    plans = []
    real = forward.make_forward_plan
    monkeypatch.setattr(forward, "make_forward_plan", lambda *a, **kw: plans.append(real(*a, **kw)) or plans[-1])
    q, k, v, sinks, do = make_inputs(1, 2, 2, 17, 9, 8, dtype=torch.float32, seed=16)
    with use_backend("triton"):
        o = attention(q, k, v, sinks=sinks.float(), scale=0.41)  # a scale not yet planned: a new plan
    assert plans and plans[-1].has_sinks and plans[-1].launch.constexprs["SINK"]
    torch.testing.assert_close(o.double(), dense_attention(q.double(), k.double(), v.double(), sinks=sinks,
                                                           scale=0.41)[0], rtol=0, atol=2e-6)  # fmt: skip


@pytest.mark.parametrize("sinks_dtype", [torch.float16, torch.float32])
def test_float16_inputs_take_float16_or_float32_sinks_on_the_triton_tier(sinks_dtype):
    q, k, v, sinks, do = make_inputs(1, 2, 1, 17, 9, 16, dtype=torch.float32, seed=19)
    q, k, v, do = (t.half() for t in (q, k, v, do))
    sinks = sinks.to(sinks_dtype)
    o, lse, grads = ours(q, k, v, sinks, do, "triton", is_causal=True)
    o_ref, lse_ref, grads_ref = truth(q, k, v, sinks, do, causal=True)
    assert o.dtype == torch.float16 and grads[3].dtype == sinks_dtype
    torch.testing.assert_close(o.double(), o_ref, rtol=0, atol=2e-3)
    torch.testing.assert_close(lse.double(), lse_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(grads[3].double(), grads_ref[3], rtol=1e-2, atol=1e-2)


def test_float8_inputs_refuse_sinks_rather_than_drop_them():
    q, k, v, sinks, _ = make_inputs(1, 2, 2, 5, 5, 16, dtype=torch.float32, seed=18)
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    with pytest.raises(ValueError, match=r"sinks are not supported with float8_e4m3fn inputs"):
        attention(q8, k8, v8, sinks=sinks.float())


@pytest.mark.parametrize("backend", SINK_TIERS)
def test_sinks_hold_at_scores_past_the_fused_steps_range_where_the_kernel_reruns_exactly(backend):
    """τ = 1e8 puts every row's shift past SHIFT_LIMIT (2^24), so the kernel starts over on its exact path,
    which must start from the sink too. Each row's softmax is one-hot at such scores: the sink wins in the
    rows whose best key scores below it (o = 0 there), the best key in the others."""
    q, k, v, _, do = make_inputs(1, 2, 2, 20, 12, 8, dtype=torch.float32, seed=20)
    scale = 1e8
    best = scale * (q.double() @ k.double().transpose(-1, -2)).amax(-1)  # (1, H, Tq)
    ranked = best.sort(dim=-1).values[0]  # (H, Tq)
    sinks = ((ranked[:, 9] + ranked[:, 10]) / 2).float()  # half the rows of each head below their sink, no tie
    o, lse, _ = ours(q, k, v, sinks, do, backend, scale=scale)
    o_ref, lse_ref, _ = truth(q, k, v, sinks, do, scale=scale)
    sink_wins = (sinks.double()[None, :, None] > best)
    assert sink_wins.any() and not sink_wins.all()  # a control: both kinds of rows are there
    torch.testing.assert_close(o.double(), o_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), lse_ref, rtol=1e-6, atol=0)


def test_an_eager_triton_call_with_sinks_runs_from_its_kept_plans(monkeypatch):
    """The kept call's kernel plans serve a call with sinks (the launcher's own plan lookups are never
    entered): with a gradient, the forward kernel's plan (its start state holds the sink) and the backward's;
    without one, a short call (Tq <= 16) the kept decode plan, whose merge counts the sink once, and a long
    one the forward plan. The second call of each layout brings new sink values to the same plans."""
    import flashtile.kernels.decode as decode
    import flashtile.kernels.forward as forward

    def refuse(*args, **kwargs):
        raise AssertionError("left the kept plans")

    monkeypatch.setattr(forward, "forward_with_spec", refuse)
    runs, plans = _counting(decode.decode_with_plan), _counting(decode.make_attention_decode_plan)
    monkeypatch.setattr(decode, "decode_with_plan", runs)
    monkeypatch.setattr(decode, "make_attention_decode_plan", plans)
    for Tq in (3, 18):  # 3: the decode route's length
        q, k, v, sinks, do = make_inputs(1, 4, 2, Tq, 11, 8, dtype=torch.float32, seed=21 + Tq)
        for seed_shift in (0.0, 1.5):  # the second call: the kept call and plans, new sink values
            o, lse, grads = ours(q, k, v, sinks + seed_shift, do, "triton", is_causal=True, alignment="lower_right")
            o_ref, lse_ref, grads_ref = truth(q, k, v, sinks + seed_shift, do, causal=True, alignment="lower_right")
            torch.testing.assert_close(o.double(), o_ref, rtol=0, atol=2e-6)
            torch.testing.assert_close(lse.double(), lse_ref, rtol=0, atol=2e-6)
            for g, g_ref in zip(grads, grads_ref):
                torch.testing.assert_close(g.double(), g_ref, rtol=0, atol=2e-5)
            before = runs.calls
            with use_backend("triton"):  # no gradient recorded: the kept forward or decode plan alone
                o_no_grad, lse_no_grad = attention(q, k, v, sinks=sinks + seed_shift, is_causal=True,
                                                   alignment="lower_right", enable_gqa=True,
                                                   return_lse=True)  # fmt: skip
            assert runs.calls - before == (Tq <= 16)  # the decode kernels ran it, or did not
            torch.testing.assert_close(o_no_grad.double(), o_ref, rtol=0, atol=2e-6)
            torch.testing.assert_close(lse_no_grad.double(), lse_ref, rtol=0, atol=2e-6)
    assert plans.calls == 1  # one decode plan, made by the first short call and kept with it


def _counting(fn):
    def counted(*args, **kwargs):
        counted.calls += 1
        return fn(*args, **kwargs)

    counted.calls = 0
    return counted


def test_sinks_values_are_read_again_after_an_in_place_write():
    """A pass of the value check is kept per tensor until it is written to: an in-place NaN is refused."""
    q, k, v, sinks, _ = make_inputs(1, 2, 2, 5, 5, 4, seed=22)
    with use_backend("reference"):
        attention(q, k, v, sinks=sinks)
        attention(q, k, v, sinks=sinks)  # the kept pass
        with torch.no_grad():
            sinks[1] = math.inf  # an optimizer's step writes in place like this
        with pytest.raises(ValueError, match=r"sinks must be finite or -inf"):
            attention(q, k, v, sinks=sinks)
        sinks[1] = 0.5
        torch.testing.assert_close(attention(q, k, v, sinks=sinks), dense_attention(q, k, v, sinks=sinks)[0],
                                   rtol=0, atol=1e-12)  # fmt: skip


def test_sinks_in_the_inputs_old_dtype_follow_them_under_autocast():
    """float16 inputs and float16 sinks under a bfloat16 autocast: the inputs are cast, and the sinks, no
    longer in the call's dtype, go in as float32 (exact), differentiable; the same answer as the call made
    on the cast inputs with float32 sinks. The reference tier (the interpreter's bfloat16 is wrong)."""
    q, k, v, sinks, _ = make_inputs(1, 2, 2, 5, 7, 8, dtype=torch.float16, seed=31)
    leaf, leaf32 = sinks.clone().requires_grad_(), sinks.float().requires_grad_()
    with use_backend("reference"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            o = attention(q, k, v, sinks=leaf)
        o_cast = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), sinks=leaf32)
    assert o.dtype == torch.bfloat16 and torch.equal(o, o_cast)
    (dsinks,) = torch.autograd.grad(o.float().sum(), leaf)
    (dsinks32,) = torch.autograd.grad(o_cast.float().sum(), leaf32)
    assert dsinks.dtype == torch.float16 and torch.equal(dsinks, dsinks32.half())
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    packed = q[0].transpose(0, 1).contiguous()  # (5, H, D): two documents
    with use_backend("reference"), torch.autocast("cpu", dtype=torch.bfloat16):
        o_varlen = flashtile_varlen(packed, packed, packed, cu, cu, 3, 3, sinks=sinks)
    assert o_varlen.dtype == torch.bfloat16
