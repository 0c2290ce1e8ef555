"""Each mistake a candidate makes, planted in a copy of a solution, fails its step with a first-level hint
(``nudge``) that names that mistake.

The PyTorch steps plant into a copy of the package's own reference modules (``flashtile.reference``);
the kernel steps plant into a copy of a reader-style Triton kernel, ``tests/practice/_reader_kernels.py``
for the forward and ``tests/practice/_reader_backward_kernel.py`` for the backward (the package's kernels are
spread over several modules). Each mistake is one or two textual edits of the source (the same line in each
kernel, where a reader would make it in both), written to a temporary file and imported from there, so the
planted code is exactly the solution with those lines changed; a plant whose text is no longer in the
source fails loudly.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from flashtile.practice.battery import run_step
from flashtile.practice.steps import step_named

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "src" / "flashtile" / "reference"
READER_KERNELS = Path(__file__).with_name("_reader_kernels.py")
READER_BACKWARD_KERNEL = Path(__file__).with_name("_reader_backward_kernel.py")
READERS = {"kernel": (READER_KERNELS, "make_forward"), "backward_kernel": (READER_BACKWARD_KERNEL, "make_backward")}

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
    # the Triton backward: planted in a copy of tests/practice/_reader_backward_kernel.py
    ("D summed over the current key tile only, in both kernels", "backward_kernel", "backward_kernel",
     [("dst = pt * (dpt - delta[None, :])", "dst = pt * (dpt - tl.sum(pt * dpt, 0)[None, :])"),
      ("ds = p * (dp - delta[:, None])", "ds = p * (dp - tl.sum(p * dp, 1)[:, None])")], "delta_tile",
     ["D summed over the current key tile"]),
    ("D summed over the key tile in the dK/dV kernel only", "backward_kernel", "backward_kernel",
     [("dst = pt * (dpt - delta[None, :])", "dst = pt * (dpt - tl.sum(pt * dpt, 0)[None, :])")], "delta_tile",
     ["D summed over the current key tile"]),
    ("dS without -D", "backward_kernel", "backward_kernel",
     [("dst = pt * (dpt - delta[None, :])", "dst = pt * dpt"), ("ds = p * (dp - delta[:, None])", "ds = p * dp")],
     "delta_missing", ["without D"]),
    ("the causal mask left out of the recomputed P in both kernels", "backward_kernel", "backward_kernel",
     [("hidden_t = hidden_t | (j[:, None] > i[None, :] + offset)", "hidden_t = hidden_t"),
      ("hidden = hidden | (j[None, :] > i[:, None] + offset)", "hidden = hidden")], "mask_backward",
     ["no mask", "recomputed P"]),
    ("the causal mask left out of the dQ kernel only", "backward_kernel", "backward_kernel",
     [("hidden = hidden | (j[None, :] > i[:, None] + offset)", "hidden = hidden")], "mask_backward",
     ["no mask", "recomputed P"]),
    ("τ missing from dK in the kernel", "backward_kernel", "backward_kernel",
     [("dk = dk * scale", "dk = dk")], "factor", ["dK", "τ missing"]),
    ("τ missing from dQ in the kernel", "backward_kernel", "backward_kernel",
     [("dq = dq * scale", "dq = dq")], "factor", ["dQ", "τ missing"]),
    ("P from exp of log2-unit scores (exp where exp2 belongs)", "backward_kernel", "backward_kernel",
     [("pt = tl.math.exp2(st - lse_col[None, :])", "pt = tl.exp(st - lse_col[None, :])"),
      ("p = tl.math.exp2(s - lse_row[:, None])", "p = tl.exp(s - lse_row[:, None])")], "p_units",
     ["exp applied to log2 units"]),
    ("lse not converted to log2 units for exp2", "backward_kernel", "backward_kernel",
     [('lse_col = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)',
       'lse_col = tl.where(lse == float("-inf"), float("inf"), lse)'),
      ('lse_row = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)',
       'lse_row = tl.where(lse == float("-inf"), float("inf"), lse)')], "p_units", ["different log units"]),
    ("qk_scale without log2(e), lse converted", "backward_kernel", "backward_kernel",
     [("qk_scale = tau * LOG2E", "qk_scale = tau")], "p_units", ["different log units"]),
    ("dV from P, not Pᵀ", "backward_kernel", "backward_kernel",
     [("dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT)",
       "dv += tl.dot(tl.trans(pt).to(do.dtype), do, input_precision=DOT)")], "dv_line", ["Pᵀ, not P"]),
    ("no guard for lse = -inf in the backward", "backward_kernel", "backward_kernel",
     [('lse_col = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)',
       "lse_col = lse * 1.4426950408889634"),
      ('lse_row = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)',
       "lse_row = lse * 1.4426950408889634")], "neg_inf", ["NaN", "lse = -inf", "P is recomputed"]),
    ("alignment ignored in the backward kernels", "backward_kernel", "backward_kernel",
     [('offset = 0 if alignment == "upper_left" else Tk - Tq', "offset = 0")], "alignment", ["alignment"]),
    ("the dK/dV grid without the batch axis", "backward_kernel", "backward_kernel",
     [("_dkdv_kernel[(triton.cdiv(Tk, block_k), H, B)]", "_dkdv_kernel[(triton.cdiv(Tk, block_k), H)]")],
     "batch", ["later batch"]),
    ("the dK/dV loop starts at the key tile's own row (offset ignored)", "backward_kernel", "backward_kernel",
     [("lo = tl.maximum(k_index * BLOCK_K - offset, 0) // BLOCK_Q * BLOCK_Q",
       "lo = k_index * BLOCK_K // BLOCK_Q * BLOCK_Q")],
     "dkdv_program", ["key tile's program", "starts under causal"]),
    ("the dQ loop's bound without the offset", "backward_kernel", "backward_kernel",
     [("hi = tl.minimum(Tk, tl.maximum(tl.minimum(q_index * BLOCK_Q + BLOCK_Q, Tq) + offset, 0))",
       "hi = tl.minimum(Tk, tl.minimum(q_index * BLOCK_Q + BLOCK_Q, Tq))")], "dq_line", ["loop over the key tiles"]),
    ("every query tile visited by the dK/dV loop under causal", "backward_kernel", "backward_kernel",
     [("for q_start in range(lo, Tq, BLOCK_Q):", "for q_start in range(0, Tq, BLOCK_Q):")], "skipped_tile_read",
     ["tiles are loaded", "where the key tile's loop over query tiles starts"]),
    ("every key tile visited by the dQ loop under causal", "backward_kernel", "backward_kernel",
     [("for k_start in range(0, hi, BLOCK_K):", "for k_start in range(0, Tk, BLOCK_K):")], "skipped_tile_read",
     ["tiles are loaded", "where the query tile's loop over key tiles ends"]),
]


def planted(tmp_path: Path, source: str, edits: list[tuple[str, str]], tag: str):
    """The solution ``source`` with ``edits`` applied, written under tmp_path and imported from there."""
    path = READERS[source][0] if source in READERS else REFERENCE / f"{source}.py"
    text = path.read_text(encoding="utf-8")
    for old, new in edits:
        assert text.count(old) == 1, f"the plant's text is not (once) in {path.name}: {old!r}"
        text = text.replace(old, new)
    # a module of flashtile.reference (its relative imports resolve there), or a top-level module for the kernel
    name = f"_planted_{tag}" if source in READERS else f"flashtile.reference._planted_{tag}"
    file = tmp_path / f"_planted_{tag}.py"
    file.write_text(text, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if source in READERS:
        return getattr(module, READERS[source][1])()
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
                         ("backward", "backward"), ("forward_kernel", "kernel"),
                         ("backward_kernel", "backward_kernel")]:
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
