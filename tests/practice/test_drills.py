"""The autograd step and the variant drills: a reader's right code passes each, and each planted bug fails
its step at a case --fast keeps, with a first-level hint that names it."""

from __future__ import annotations

import pytest

from flashtile.practice.battery import run_step
from flashtile.practice.steps import step_named

from . import _reader_drills as drills

CONTROLS = {
    "autograd": drills.make_autograd,
    "gqa": drills.make_gqa,
    "window": drills.make_window,
    "paged": drills.make_decode,
    "decode": drills.make_decode,
    "varlen": drills.make_varlen,
    "sink": drills.make_sinks,
    "sink_gradient": drills.make_sink_gradient,
}


@pytest.mark.parametrize("step", list(CONTROLS))
def test_a_readers_right_code_passes_the_drill(step):
    result = run_step(step_named(step), CONTROLS[step]())
    assert result.ok, [(f.case, f.error) for f in result.failures]
    assert result.passed == len(step_named(step).cases()) >= 3


# (bug, step, the implementation, a phrase of the first failing case, the rule, words of its nudge)
PLANTED = [
    ("causal not passed to the backward", "autograd", lambda: drills.make_autograd(causal_to_backward=False),
     "causal: the mask reaches", "wiring", ["does not reach the backward"]),
    ("scale not passed to the backward", "autograd", lambda: drills.make_autograd(scale_to_backward=False),
     "no mask: o and its gradients", "wiring", ["ctx"]),
    ("autograd through the tiles, no Function", "autograd", lambda: drills.make_autograd(no_function=True),
     "saved for the backward", "saved", ["saved more than q, k, v, o and lse"]),
    ("o returned detached", "autograd", lambda: drills.make_autograd(detached=True), "no mask", "no_grad",
     ["no gradient"]),
    ("key/value head h % H_kv", "gqa", lambda: drills.make_gqa(interleaved=True), "groups of 2", "gqa_head_map",
     ["h % H_kv"]),
    ("the window's left bound exclusive", "window", lambda: drills.make_window(edge=True), "window (8, 8)",
     "window_edge", ["one key narrower"]),
    ("the window without the alignment's offset", "window", lambda: drills.make_window(no_offset=True),
     "causal lower_right", "window_offset", ["other diagonal"]),
    ("every key tile visited under a window", "window", lambda: drills.make_window(skip_tiles=False),
     "outside every window", "window_tiles", ["loaded"]),
    ("page j instead of table_row[j]", "paged", lambda: drills.make_decode(ignore_table=True), "shuffled table",
     "block_table", ["table_row[j]"]),
    ("the partials averaged", "decode", lambda: drills.make_decode(merge="mean"), "3 splits (the merge)",
     "split_merge", ["merge of the splits' partials"]),
    ("the whole cache attended", "decode", lambda: drills.make_decode(lengths=False), "1 split", "cache_lengths",
     ["cache_seqlens"]),
    ("new tokens upper-left", "decode", lambda: drills.make_decode(lower_right=False), "1 split",
     "decode_alignment", ["last Tq positions"]),
    ("documents attended as one sequence", "varlen", lambda: drills.make_varlen(documents=False), "3 documents",
     "documents", ["other documents' keys"]),
    ("l started at 0", "sink", lambda: drills.make_sinks(l_start=0.0), "τ = 0.3, no mask", "sink_start",
     ["without the sink", "starts from"]),
    ("acc started at the sink's l (a value of 1)", "sink", lambda: drills.make_sinks(acc_like_l=True),
     "τ = 0.3, no mask", "sink_value", ["carries a value", "acc"]),
    ("the sink a column of every key tile", "sink", lambda: drills.make_sinks(per_tile=True), "3 key tiles",
     "sink_per_tile", ["once per key tile"]),
    ("the sink multiplied by τ", "sink", lambda: drills.make_sinks(sink_scaled=True), "τ = 0.3", "sink_scale",
     ["multiplied", "τ"]),
    ("the key/value head's sink", "sink", lambda: drills.make_sinks(sink_of_kv_head=True), "a sink per query head",
     "sink_head", ["one sink per query head"]),
    ("key/value head h % H_kv under a sink", "sink", lambda: drills.make_sinks(interleaved=True),
     "a sink per query head", "gqa_head_map", ["h % H_kv"]),
    ("a row with no key written without its sink", "sink", lambda: drills.make_sinks(empty_rows_no_sink=True),
     "27 rows see no key", "sink_empty_row", ["still has its sink"]),
    ("exp(-inf - (-inf)) under a sink of -inf", "sink", lambda: drills.make_sinks(guard_neg_inf=False),
     "27 rows see no key", "neg_inf", ["no sink", "exp(-inf - (-inf))"]),
    ("dsink with the wrong sign", "sink_gradient", lambda: drills.make_sink_gradient(sign=1), "no mask",
     "dsink_sign", ["times -1"]),
    ("dsink without e^(sink - lse)", "sink_gradient", lambda: drills.make_sink_gradient(weighted=False),
     "no mask", "dsink_weight", ["e^(sink - lse)"]),
    ("dsink averaged over the batch", "sink_gradient", lambda: drills.make_sink_gradient(batch="mean"),
     "both batch elements", "dsink_batch", ["every batch element"]),
    ("dsink of batch 0 only", "sink_gradient", lambda: drills.make_sink_gradient(batch="first"),
     "both batch elements", "dsink_batch", ["one batch element"]),
    ("dsink's weight unguarded where lse = -inf", "sink_gradient",
     lambda: drills.make_sink_gradient(guard_neg_inf=False), "11 rows see no key", "neg_inf", ["lse = -inf"]),
]


@pytest.mark.parametrize("bug, step, impl, case, rule, words", PLANTED, ids=[p[0] for p in PLANTED])
def test_a_planted_bug_fails_its_drill_with_a_nudge_that_names_it(bug, step, impl, case, rule, words):
    result = run_step(step_named(step), impl(), fast=True, stop_at_first_failure=True)
    assert not result.ok, f"{bug}: {step} passed"
    first = result.failures[0]
    assert case in first.case, (bug, first.case, first.error)
    assert first.hint.name == rule, (bug, first.case, first.error, first.hint)
    for word in words:
        assert word in first.hint.nudge, (bug, word, first.hint.nudge)


@pytest.mark.parametrize("bug, step, impl, case, rule, words", PLANTED, ids=[p[0] for p in PLANTED])
def test_every_case_a_planted_bug_fails_names_the_same_bug(bug, step, impl, case, rule, words):
    result = run_step(step_named(step), impl())
    assert result.failures and {f.hint.name for f in result.failures} == {rule}, [
        (f.case, f.hint.name) for f in result.failures]
