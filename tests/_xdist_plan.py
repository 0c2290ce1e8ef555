"""How ``make test`` deals the suite out to its two pytest-xdist workers (a pytest plugin, loaded by the root
conftest).

1. ``xdist_group`` is honoured. With ``--dist loadgroup`` pytest-xdist puts a grouped test's group into its
   node id ("...::test[p]@group") and deals out one unit per group. It writes the id through the private
   ``item._nodeid``, which pytest 9.2 no longer reads (node ids are structured there, ``item._id``), so the
   groups were silently ignored: the gloo ring's tests were dealt to both workers and each started the
   ring's process groups again (pytest-xdist issue 1386). Here the same id is written where this pytest
   reads it; where xdist's own write took effect, nothing is done.
2. The longest tests start first. The scheduler deals out the groups first (largest first), then single
   tests in collection order, each to whichever worker asks next; a long test dealt out last keeps one
   worker busy while the other has finished. ``LONGEST`` lists the tests that take several seconds on the
   2-core machine (measured with ``--durations``, seconds of one worker under a full run); they are moved
   to the front, longest first, everything else keeps its order. A name no longer collected is ignored,
   and a new long test that is not listed only runs where it is collected.
"""

from __future__ import annotations

import pytest

# node id, its part before "[" (every parametrisation), or its file (every item of it, for the docs' claims,
# whose ids are line numbers): seconds of one worker in a full ``make test-unit`` run at 69d05a6 (one thread
# per worker, see the root conftest); the groups (the gloo ring, the sm_90 compiles) are dealt out first anyway
LONGEST = {
    "tests/kernels/test_properties.py::test_forward_and_backward_match_float64_for_any_input": 25.0,
    "tests/test_mutants.py::test_each_planted_bug_fails_the_test_that_guards_it": 9.7,
    "docs/practice/practice-mode.md": 8.2,  # a run of the checker
    "tests/practice/test_cli.py::test_the_readers_code_cannot_stop_or_hang_the_checker": 8.1,
    "docs/part-c/ring-attention.md": 5.4,  # a ring of two processes
    # these two measured with -n 0 on the 2-core machine under other work, not in a full run
    "tests/practice/test_cli.py::test_a_spawned_worker_gives_the_same_verdicts_as_a_forked_one": 12.7,
    "tests/practice/test_adversarial_readers.py::test_forged_results_written_through_any_reachable_channel_do_not_pass":
        4.5,
    "tests/practice/test_cli.py::test_check_on_skeletons_and_a_planted_bug_fails_every_step_with_help": 4.9,
    "docs/part-c/decode.md": 4.8,
    "docs/part-c/in-a-model.md": 4.2,
    "tests/practice/test_cli.py::test_check_passes_when_the_packages_functions_are_copied_in": 3.9,
    "tests/test_api.py::test_output_is_laid_out_like_a_dense_query_on_every_tier[triton]": 3.6,
    "tests/bench/test_ring_parts.py::test_cpu_smoke_writes_one_schema_row_per_part": 3.4,
    "docs/part-b/forward-kernel.md": 2.5,
    "tests/integrations/test_transformers.py::"
    "test_left_padded_batch_matches_eager_on_real_tokens_and_generates_the_same": 2.2,
    "docs/part-b/backward-kernel.md": 2.1,
    "tests/integrations/test_train_step_bench.py::test_train_step_rows_follow_the_schema_on_a_toy_model": 2.0,
}


def _group(item: pytest.Item) -> str | None:
    names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
    return "_".join(sorted(names)) or None


def _seconds(item: pytest.Item) -> float:
    nodeid = item.nodeid.split("@")[0]
    for key in (nodeid, nodeid.split("[")[0], nodeid.split("::")[0]):
        if key in LONGEST:
            return LONGEST[key]
    return 0


@pytest.hookimpl(trylast=True)  # after pytest's own reordering (by parametrised fixtures) and xdist's
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if getattr(config.option, "loadgroup", False):  # set on the workers of --dist loadgroup
        try:
            from _pytest.nodeid import NodeId  # pytest >= 9.2; before it, xdist's own write took effect
        except ImportError:
            NodeId = None
        for item in items if NodeId is not None else ():
            group = _group(item)
            if group and not item.nodeid.endswith(f"@{group}") and hasattr(item, "_id"):
                item._id = NodeId.parse(f"{item.nodeid}@{group}")
    if getattr(config, "workerinput", None) is not None:  # a worker: the controller deals out in this order
        # sorted is stable: the listed tests in order of seconds, then every other test in collection order
        items[:] = sorted(items, key=lambda item: 0 if _group(item) else -_seconds(item))
