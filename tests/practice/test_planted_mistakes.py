"""Each mistake a candidate makes, planted in a copy of a solution, fails its step with a first-level hint
(``nudge``) that names that mistake.

The PyTorch steps plant into a copy of the package's own reference modules (``flashtile.reference``);
the kernel step plants into a copy of the reader-style Triton kernel of ``tests/practice/_reader_kernels.py``
(the package's kernel is spread over several modules). Each mistake is one textual edit of the source,
written to a temporary file and imported from there, so the planted code is exactly the solution with
that one line changed; a plant whose text is no longer in the source fails loudly.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from flashtile.practice.battery import run_step, step_named

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "src" / "flashtile" / "reference"
READER_KERNELS = Path(__file__).with_name("_reader_kernels.py")

# (mistake, step, source file, [(text, replacement), ...], the rule's name, words its nudge must contain)
PLANTS = [
    ("l not rescaled in the online update", "online_softmax", "online_softmax",
     [("l_new = alpha * l + safe_exp_diff(", "l_new = l + safe_exp_diff(")], "rescale", ["new max"]),
    ("lse_from_stats in log2", "online_softmax", "online_softmax",
     [("m + torch.log(l))", "m + torch.log2(l))")], "log_base", ["log bases", "log2(e)"]),
    ("merge without the -inf guard", "online_softmax", "online_softmax",
     [("l = safe_exp_diff(m_a, m) * l_a + safe_exp_diff(m_b, m) * l_b",
       "l = torch.exp(m_a - m) * l_a + torch.exp(m_b - m) * l_b")], "neg_inf", ["-inf"]),
    ("merge that adds l_a + l_b", "online_softmax", "online_softmax",
     [("l = safe_exp_diff(m_a, m) * l_a + safe_exp_diff(m_b, m) * l_b", "l = l_a + l_b")], "rescale",
     ["l_a + l_b", "common max"]),
    ("l not rescaled in the forward", "forward", "forward",
     [("l = alpha * l + p.sum(dim=-1)", "l = l + p.sum(dim=-1)")], "rescale_l", ["not l", "update of l"]),
    ("acc not rescaled in the forward", "forward", "forward",
     [("acc = alpha.to(acc.dtype)[..., None] * acc + pv", "acc = acc + pv")], "rescale_acc",
     ["not acc", "update of acc"]),
    ("acc divided by l on every tile (o = acc / l again at the end)", "forward", "forward",
     [("        m = m_new\n", "        acc = acc / torch.where(l == 0, 1.0, l).to(acc.dtype)[..., None]\n"
                             "        m = m_new\n")], "normalised_acc", ["divides acc by l on every tile"]),
    ("acc divided by l on every tile (returned as o)", "forward", "forward",
     [("        m = m_new\n", "        acc = acc / torch.where(l == 0, 1.0, l).to(acc.dtype)[..., None]\n"
                             "        m = m_new\n"),
      ("acc / torch.where(empty, 1.0, l_c[..., None])", "acc")], "normalised_acc",
     ["divides acc by l on every tile"]),
    ("exp on log2(e)-scaled scores", "forward", "forward",
     [("s = scale * (q_tile @ k", "s = scale * 1.4426950408889634 * (q_tile @ k")], "temperature_log2e",
     ["τ·log2(e)", "exp"]),
    ("a causal mask that hides the diagonal", "causal", "forward",
     [("    band = window_band(shape.Tq, shape.Tk, window, causal, alignment)\n",
       "    band = window_band(shape.Tq, shape.Tk, window, causal, alignment)\n"
       "    band = type(band)(band.lo, band.hi - 1) if causal else band\n")], "strict_mask", ["diagonal"]),
    ("D summed over the current key tile only", "backward", "backward",
     [("ds = p * (dp - delta[..., q_start:q_end, None])", "ds = p * (dp - (p * dp).sum(-1, keepdim=True))")],
     "delta_tile", ["D summed over the current key tile"]),
    ("D left out of dS", "backward", "backward",
     [("ds = p * (dp - delta[..., q_start:q_end, None])", "ds = p * dp")], "delta_missing", ["without D"]),
    ("τ missing from dK", "backward", "backward",
     [("dk += scale * (ds.transpose(-1, -2) @ q_tile)", "dk += ds.transpose(-1, -2) @ q_tile")], "factor",
     ["dK", "τ missing"]),
    ("τ missing from dQ", "backward", "backward",
     [("dq[..., q_start:q_end, :] += scale * (ds @ k_tile)", "dq[..., q_start:q_end, :] += ds @ k_tile")],
     "factor", ["dQ", "τ missing"]),
    ("the mask left out of the recomputed P", "backward", "backward",
     [("visible = band_keeps(i, j, band)", "visible = None")], "mask_backward", ["no mask", "recomputed P"]),
    ("tl.exp2 without the log2(e) factor", "forward_kernel", "kernel",
     [("H, Tq, Tk, offset, tau * math.log2(math.e),", "H, Tq, Tk, offset, tau,")], "temperature_ln2",
     ["τ·ln 2", "exp2"]),
    ("exp on log2(e)-scaled scores in the kernel", "forward_kernel", "kernel",
     [("alpha = tl.math.exp2(m.to(tl.float32) - m_sub)", "alpha = tl.exp(m.to(tl.float32) - m_sub)"),
      ("p = tl.math.exp2(s - m_sub[:, None])", "p = tl.exp(s - m_sub[:, None])")], "temperature_log2e",
     ["τ·log2(e)", "exp"]),
    ("lse in mixed log units (m converted, log2 l not)", "forward_kernel", "kernel",
     [("lse = lse * 0.6931471805599453  # log2 units back to natural log",
       "lse = m.to(tl.float32) * 0.6931471805599453 + tl.math.log2(tl.where(empty, 1.0, l.to(tl.float32)))")],
     "log_base", ["mixes log bases"]),
    ("acc not rescaled in the kernel", "forward_kernel", "kernel",
     [("acc = acc * alpha[:, None] + tl.dot(", "acc = acc + tl.dot(")], "rescale_acc", ["not acc"]),
]


def planted(tmp_path: Path, source: str, edits: list[tuple[str, str]], tag: str):
    """The solution ``source`` with ``edits`` applied, written under tmp_path and imported from there."""
    path = READER_KERNELS if source == "kernel" else REFERENCE / f"{source}.py"
    text = path.read_text(encoding="utf-8")
    for old, new in edits:
        assert text.count(old) == 1, f"the plant's text is not (once) in {path.name}: {old!r}"
        text = text.replace(old, new)
    # a module of flashtile.reference (its relative imports resolve there), or a top-level module for the kernel
    name = f"_planted_{tag}" if source == "kernel" else f"flashtile.reference._planted_{tag}"
    file = tmp_path / f"_planted_{tag}.py"
    file.write_text(text, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if source == "kernel":
        return module.make_forward()
    return module


@pytest.mark.parametrize("mistake, step, source, edits, rule, words", PLANTS, ids=[p[0] for p in PLANTS])
def test_a_planted_mistake_fails_its_step_with_a_nudge_that_names_it(tmp_path, mistake, step, source, edits, rule,
                                                                     words):
    tag = "".join(c if c.isalnum() else "_" for c in mistake)[:40]
    impl = planted(tmp_path, source, edits, tag)
    result = run_step(step_named(step), impl, fast=True, stop_at_first_failure=True)
    assert not result.ok, f"{mistake}: step {step} passed"
    hint = result.failures[0].hint
    assert hint.name == rule, f"{mistake}: {result.failures[0].case}: {result.failures[0].error}\n{hint}"
    for word in words:
        assert word in hint.nudge, (mistake, word, hint.nudge)
    if hint.formula:  # the formula is the second level only
        assert hint.formula not in hint.nudge and hint.formula in hint.text("formula")


def test_the_control_unplanted_copies_pass(tmp_path):
    """The copies themselves, with no edit, pass their steps: each failure above is the plant's."""
    for step, source in [("online_softmax", "online_softmax"), ("forward", "forward"), ("causal", "forward"),
                         ("backward", "backward"), ("forward_kernel", "kernel")]:
        result = run_step(step_named(step), planted(tmp_path, source, [], f"control_{step}"), fast=True)
        assert result.ok, (step, [(f.case, f.error) for f in result.failures])


def test_at_least_fourteen_mistakes_and_every_rule_of_the_issue_list():
    assert len(PLANTS) >= 14
    assert {"rescale", "rescale_l", "rescale_acc", "normalised_acc", "temperature_log2e", "temperature_ln2",
            "strict_mask", "delta_tile", "factor", "log_base"} <= {p[4] for p in PLANTS}


@pytest.mark.parametrize("mistake, step, source, edits, rule, words", PLANTS, ids=[p[0] for p in PLANTS])
def test_every_case_a_planted_mistake_fails_names_the_same_mistake(tmp_path, mistake, step, source, edits, rule,
                                                                   words):
    """Under -v every failing case is shown: each must name the one mistake, not a different guess per case."""
    tag = "".join(c if c.isalnum() else "_" for c in mistake)[:40] + "_all"
    result = run_step(step_named(step), planted(tmp_path, source, edits, tag))
    # a case on which two mistakes give the same output names both ("mask_backward+alignment"), this one among them
    assert result.failures and all(rule in f.hint.name.split("+") for f in result.failures), [
        (f.case, f.hint.name) for f in result.failures]
