"""``flashtile._plans``: a plan is worked out once per layout and flag values, and never shared wrongly."""

import torch

from flashtile import _plans

LAUNCH = dict(grid=(1,), scalars=(), constexprs={}, num_warps=4, num_stages=3)  # a stand-in launch's settings


def _counting_plan(calls):
    def make_plan(x, flag):
        calls.append((tuple(x.shape), flag))
        return object()

    return make_plan


def test_one_layout_and_flag_value_make_one_plan_whatever_the_values(monkeypatch):
    monkeypatch.setattr(_plans, "_plans", {})
    calls = []
    make_plan = _counting_plan(calls)
    first = _plans.cached_plan(make_plan, (torch.randn(3, 5),), True)
    again = _plans.cached_plan(make_plan, (torch.randn(3, 5),), True)  # new values, new address, same layout
    assert again is first and len(calls) == 1


def test_flags_that_compare_equal_but_differ_in_type_get_their_own_plans(monkeypatch):
    monkeypatch.setattr(_plans, "_plans", {})
    calls = []
    make_plan = _counting_plan(calls)
    x = torch.randn(3, 5)
    plans = {_plans.cached_plan(make_plan, (x,), flag) for flag in (True, 1, 1.0)}  # 1 == True == 1.0
    assert len(plans) == 3 and len(calls) == 3


def test_a_layout_differs_by_strides_dtype_alignment_and_tensor_type(monkeypatch):
    monkeypatch.setattr(_plans, "_plans", {})
    calls = []
    make_plan = _counting_plan(calls)
    x = torch.randn(4, 6)

    class Marked(torch.Tensor):  # a subclass must never ride on a plain tensor's plan
        pass

    variants = [x, x.t().contiguous().t(), x.double(), torch.randn(25)[1:].view(4, 6), x.as_subclass(Marked)]
    for v in variants:
        _plans.cached_plan(make_plan, (v,), False)
    assert len(calls) == len(variants)


def test_what_cannot_form_a_key_goes_straight_to_the_plan(monkeypatch):
    monkeypatch.setattr(_plans, "_plans", {})
    calls = []
    make_plan = _counting_plan(calls)
    for _ in range(2):
        _plans.cached_plan(make_plan, (torch.randn(2, 2),), [True])  # an unhashable flag: no key, no caching
    assert len(calls) == 2 and not _plans._plans


def test_the_plan_table_starts_over_when_full(monkeypatch):
    monkeypatch.setattr(_plans, "MAX_PLANS", 2)
    monkeypatch.setattr(_plans, "_plans", {})
    make_plan = _counting_plan([])
    for n in (17, 18, 19):
        _plans.cached_plan(make_plan, (torch.randn(n),), False)
    assert 1 <= len(_plans._plans) <= 2


def test_a_key_built_by_its_caller_is_kept_and_found_and_none_or_an_unhashable_one_never_is(monkeypatch):
    monkeypatch.setattr(_plans, "_plans", {})
    plan = object()
    assert _plans.keep_plan(("call", 1), plan) is plan and _plans.kept_plan(("call", 1)) is plan
    assert _plans.kept_plan(("call", True)) is plan  # equal keys are one key: callers put each flag's type in theirs
    assert _plans.keep_plan(None, plan) is plan and _plans.kept_plan(None) is None
    assert _plans.keep_plan(("call", [1]), plan) is plan and _plans.kept_plan(("call", [1])) is None
    assert list(_plans._plans) == [("call", 1)]


def test_a_launch_its_plan_keys_finds_its_kernel_by_the_device_alone():
    """``KernelLaunch(plan_keyed=True)``: the plan that holds it is kept under every input's dtype and alignment,
    so the compiled kernel is kept per device, and a call reads no tensor for it."""
    from types import SimpleNamespace

    from flashtile.kernels import _host

    class StandIn(_host.KernelLaunch):  # Triton's full path stood in for: compiles nothing
        __slots__ = ()

        def _full_launch(self, tensors):
            return SimpleNamespace(run=None, function=None, packed_metadata=None)

    kernel = SimpleNamespace(arg_names=["x", "out"])
    keyed = StandIn(kernel, **LAUNCH, fresh_outputs=1, plan_keyed=True)
    unkeyed = StandIn(kernel, **LAUNCH, fresh_outputs=1)
    x, out = torch.empty(8), torch.empty(8)
    for launch in (keyed, unkeyed):
        launch._compile_and_launch((x, out), 0)
    assert list(keyed._compiled) == [0]
    assert list(unkeyed._compiled) == [(0, _host.specialization(x))]
    assert not keyed.direct and not unkeyed.direct  # not a JITFunction: every call takes Triton's full path
