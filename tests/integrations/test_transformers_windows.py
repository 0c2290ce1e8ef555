"""flashtile inside transformers on the masks beyond plain causal: sliding windows (Mistral, Qwen2 with
use_sliding_window, Gemma-2's alternating layers with soft-capped scores), packed rows and padded batches.

The truth is transformers' own eager attention (matmul + softmax + its mask, no flashtile), in float64
where there is no padding and in float32 with padding (test_transformers.py, PADDED_TRUTH, says why).
Each case also has a control that shows the feature matters in it: the eager model without the window,
the cap or the documents gives logits far from the truth, so a flashtile that ignored them would fail.
flashtile runs its reference tier here (the Triton interpreter costs about 5 s per training step of these
models); one test runs the kernels through the interpreter, and the GPU test runs them in bf16.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import flashtile.integrations.transformers as integration  # noqa: E402
from flashtile.api import use_backend  # noqa: E402
from flashtile.integrations.transformers import register  # noqa: E402
from tests.integrations._hf_models import (  # noqa: E402
    bf16_logit_errors,
    build,
    cache_argument,
    gemma2_config,
    llama_config,
    max_rel_grad_error,
    mistral_config,
    qwen2_window_config,
    token_ids,
    twins,
)

LOGITS_ATOL = 2e-4  # float32 against float64 (or float32): measured errors are about 1e-5
GRAD_RTOL = 2e-4  # max |grad error| / max |grad|, per parameter
FAR = 100 * LOGITS_ATOL  # what a control must miss the truth by
GREEDY = dict(do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def name():
    return register()


def assert_step_matches(truth, ours, ids, **inputs):
    """One training step on both: logits on the real tokens and every parameter's gradient.

    With padding, a token is a label only if it and the token before it are real: the loss reads the logits
    of the position before each label, and a padding position's logits are eager's average of values there
    but zeros from flashtile (no real token ever reads them, but the label after a left padding would)."""
    labels = ids
    if "attention_mask" in inputs:
        real = inputs["attention_mask"].bool()
        labels = ids.masked_fill(~real, -100)
        labels[:, 1:] = labels[:, 1:].masked_fill(~real[:, :-1], -100)
    expected = truth(ids, labels=labels, **inputs)
    expected.loss.backward()
    with use_backend("reference"):
        got = ours(ids, labels=labels, **inputs)
        got.loss.backward()
    real = inputs.get("attention_mask", torch.ones_like(ids)).bool()
    assert (got.logits.double() - expected.logits.double())[real].abs().max().item() < LOGITS_ATOL
    err, where = max_rel_grad_error(truth, ours)
    assert err < GRAD_RTOL, f"{where}: {err}"
    return expected.logits.detach()


def assert_generates_the_same(truth, ours, ids, max_new_tokens: int = 8, **inputs):
    expected = truth.generate(ids, max_new_tokens=max_new_tokens, **inputs, **GREEDY)
    with use_backend("reference"):
        got = ours.generate(ids, max_new_tokens=max_new_tokens, **inputs, **GREEDY)
    assert got.shape == expected.shape and torch.equal(got, expected)


def eager_without(config, **change):
    """The eager model of ``config`` with one setting changed (the control), same weights as twins()."""
    return build(config.__class__(**{**config.to_dict(), **change}), "eager", dtype=torch.float64)


def test_transformers_window_is_w_keys_back_the_query_included():
    """The off-by-one this integration maps: transformers' sliding mask keeps p - W < j <= p, which is
    flashtile's window (W - 1, 0). Read from transformers' own mask function, not from its docs."""
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    W, T = 3, 7
    mask = sdpa_mask(batch_size=1, q_length=T, kv_length=T, mask_function=sliding_window_causal_mask_function(W),
                     allow_is_causal_skip=False)[0, 0]  # fmt: skip
    p, j = torch.arange(T)[:, None], torch.arange(T)
    assert torch.equal(mask, (j <= p) & (j >= p - (W - 1)))
    assert integration.layer_window(W, True, T) == (W - 1, 0)
    assert integration.layer_window(W, True, W) is None  # W keys or fewer: nothing to cut


def test_mistral_window_shorter_than_the_sequence_matches_eager(name):
    config = mistral_config(sliding_window=5)
    truth, ours = twins(config, name)
    ids = token_ids(2, 16)
    logits = assert_step_matches(truth, ours, ids)
    with torch.no_grad():  # control: without its window the same weights give other logits
        assert (eager_without(config, sliding_window=None)(ids).logits - logits).abs().max().item() > FAR
    assert_generates_the_same(truth, ours, ids[:, :6])  # 6 + 8 tokens: the cache outgrows the window


def test_mistral_window_with_left_padding_generates_like_eager(name):
    """Left padding, a window and a cache together: a dynamic cache, a static one (its windowed layers keep
    W slots), and a chunked prefill (6 tokens, then 3 against the cache: Tq < Tk, lower-right, windowed)."""
    from transformers import DynamicCache

    truth, ours = twins(mistral_config(sliding_window=5), name, truth_dtype=torch.float32)  # PADDED_TRUTH
    ids, mask = token_ids(2, 9), torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    assert_generates_the_same(truth, ours, ids, attention_mask=mask)
    assert_generates_the_same(truth, ours, ids, max_new_tokens=4, attention_mask=mask, cache_implementation="static")
    logits = []
    for model in (truth, ours):
        with torch.no_grad(), use_backend("reference"):
            cache = DynamicCache(config=model.config)
            model(ids[:, :6], attention_mask=mask[:, :6], use_cache=True, **{cache_argument(model): cache})
            logits.append(model(ids[:, 6:], attention_mask=mask, **{cache_argument(model): cache}).logits)
    assert (logits[0] - logits[1]).abs().max().item() < LOGITS_ATOL


def test_qwen2_with_use_sliding_window_matches_eager(name):
    config = qwen2_window_config(sliding_window=5)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    truth, ours = twins(config, name)
    ids = token_ids(2, 16)
    logits = assert_step_matches(truth, ours, ids)
    with torch.no_grad():
        control = eager_without(config, use_sliding_window=False, layer_types=None)(ids).logits
        assert (control - logits).abs().max().item() > FAR
    assert_generates_the_same(truth, ours, ids[:1, :6])


def test_gemma2_soft_cap_scale_and_alternating_windows_match_eager(name):
    config = gemma2_config(sliding_window=5, softcap=5.0)
    assert config.layer_types == ["sliding_attention", "full_attention"]
    truth, ours = twins(config, name)
    ids = token_ids(2, 16)
    logits = assert_step_matches(truth, ours, ids)
    with torch.no_grad():  # controls: the cap and the window each change these logits
        for change in (dict(attn_logit_softcapping=None), dict(sliding_window=64)):
            assert (eager_without(config, **change)(ids).logits - logits).abs().max().item() > FAR, change
    assert_generates_the_same(truth, ours, ids[:1, :6])


def test_packed_rows_match_eager_and_each_document_alone(name):
    """DataCollatorWithFlattening's layout: one row, positions restarting at each document. Mistral, so a
    document longer than the window meets both. The truth is eager with use_cache=False (the only way
    transformers' eager mask honours the positions); flashtile gives the same logits with the cache on,
    and with cu_seq_lens_q / cu_seq_lens_k instead of positions."""
    config = mistral_config(sliding_window=5)
    truth, ours = twins(config, name)
    lengths = [7, 3, 6]
    ids = token_ids(1, sum(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    logits = assert_step_matches(truth, ours, ids, position_ids=positions, use_cache=False)
    bounds = torch.tensor([0, 7, 10, 16], dtype=torch.int32)
    flash_kwargs = dict(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=7, max_length_k=7)
    with torch.no_grad(), use_backend("reference"):
        assert (ours(ids, position_ids=positions).logits.double() - logits).abs().max().item() < LOGITS_ATOL
        assert (ours(ids, position_ids=positions, **flash_kwargs).logits.double() - logits).abs().max() < LOGITS_ATOL
        start = 0
        for n in lengths:  # a second truth: each document's logits are its own, alone
            alone = truth(ids[:, start : start + n]).logits
            assert (logits[:, start : start + n] - alone).abs().max().item() < LOGITS_ATOL
            start += n
        control = truth(ids).logits  # the row as one sequence
        assert (control - logits).abs().max().item() > FAR


def test_padded_batch_is_one_varlen_call_per_layer_and_matches_eager(name, monkeypatch):
    """Left and right padding in one training batch: each layer makes one attention_varlen call (no loop
    over sequences), and the real tokens' logits and every gradient match eager's."""
    calls = []
    varlen = integration.attention_varlen
    monkeypatch.setattr(integration, "attention_varlen", lambda *a, **k: calls.append(a[3].tolist()) or varlen(*a, **k))
    monkeypatch.setattr(integration, "attention", None)  # no other path may run
    truth, ours = twins(llama_config(), name, truth_dtype=torch.float32)  # see PADDED_TRUTH
    ids, mask = token_ids(3, 12), torch.ones(3, 12, dtype=torch.long)
    mask[0, :5] = 0  # left padding
    mask[1, 9:] = 0  # right padding
    assert_step_matches(truth, ours, ids, attention_mask=mask)
    assert calls == [[0, 7, 16, 28]] * ours.config.num_hidden_layers  # 7, 9 and 12 real tokens, packed


def test_padded_gemma2_runs_the_kernels_like_eager(name):
    """The Triton kernels (through the interpreter) on a padded batch with a window and a soft-cap: the
    varlen kernel's forward, one layer windowed, one global."""
    truth, ours = twins(gemma2_config(sliding_window=5, num_hidden_layers=2), name, truth_dtype=torch.float32)
    ids, mask = token_ids(2, 12), torch.ones(2, 12, dtype=torch.long)
    mask[0, :4] = 0
    with torch.no_grad(), use_backend("triton"):
        got = ours(ids, attention_mask=mask).logits
    expected = truth(ids, attention_mask=mask).logits
    assert (got - expected)[mask.bool()].abs().max().item() < LOGITS_ATOL


def test_a_block_mask_is_refused_not_ignored(name):
    """A mask that is not causal on runs of real tokens (here a prefix-LM block: the first 4 tokens see each
    other both ways) raises rather than run as causal."""
    _, ours = twins(llama_config(), name)
    T = 8
    block = torch.ones(T, T).tril().bool()
    block[:4, :4] = True
    with pytest.raises(ValueError, match="has no attn_mask"):
        ours(token_ids(1, T), attention_mask=block[None, None])


def test_a_window_or_packed_rows_on_a_non_causal_layer_are_refused(name):
    """transformers' bidirectional window is |i - j| <= W, not (W - 1, 0): not mapped, so refused; packed
    documents would need a non-causal segment call, which the integration does not make."""
    layer = torch.nn.Module()
    layer.is_causal = False
    q, k, v = torch.randn(3, 1, 4, 8, 16)
    with pytest.raises(ValueError, match="causal layers only"):
        integration.flashtile_attention_forward(layer, q, k, v, None, sliding_window=4)
    integration.flashtile_attention_forward(layer, q, k, v, None, sliding_window=8)  # cuts nothing: runs
    with pytest.raises(ValueError, match="packed rows on causal layers only"):  # nor packed documents
        integration.flashtile_attention_forward(layer, q, k, v, None, position_ids=torch.tensor([[0, 1, 2, 0] * 2]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_windows_in_bf16_on_the_gpu_are_as_accurate_as_transformers_own(name, family):
    """bf16 on the kernels, padded and unpadded, against a float32 eager truth: flashtile's largest logit
    error may not exceed that of transformers' own bf16 attention with the same mask (SDPA for Mistral;
    eager for Gemma-2, which has no SDPA path because of its soft-cap) by more than 25 % (a maximum over
    the whole model's bf16 rounding is noisy; a wrong window or cap is off by far more). T = 384, W = 128."""
    configs = {"mistral": mistral_config, "gemma2": gemma2_config}
    sizes = dict(max_position_embeddings=512, vocab_size=512, hidden_size=256, intermediate_size=512,
                 num_attention_heads=4, head_dim=64, initializer_range=0.1)  # fmt: skip
    config = configs[family](sliding_window=128, **sizes)
    ids = torch.randint(1, 512, (2, 384), generator=torch.Generator().manual_seed(1)).cuda()
    mask = torch.ones_like(ids)
    mask[0, :100] = 0
    truth = build(config, "eager").cuda()
    with torch.no_grad():  # control: the window matters here far beyond bf16 rounding (measured ~40x on a CPU)
        unwindowed = build(configs[family](sliding_window=None if family == "mistral" else 512, **sizes), "eager")
        control = (unwindowed.cuda()(ids).logits - truth(ids).logits).abs().max().item()
    baseline = "sdpa" if family == "mistral" else "eager"
    errors, _ = bf16_logit_errors(truth, config, (name, baseline), ids, mask)
    for padded in (False, True):
        assert errors[name, padded] <= 1.25 * errors[baseline, padded] + 1e-2, errors
    assert control > 4 * max(errors.values()), (control, errors)


def test_a_mask_written_in_place_is_read_again():
    """The segments are kept on the mask tensor for the layers after the first; a mask changed in place
    between calls must not reuse the old reading."""
    q = torch.randn(2, 4, 6, 8)
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    first = integration.segment_plan(mask, None, q, q, None, True)
    assert first.whole == (0, 6)  # no padding: one call on every key
    mask[0, 0, :, :2] = False  # left padding of 2 in sequence 0
    again = integration.segment_plan(mask, None, q, q, None, True)
    assert again.whole is None and again.cu_seqlens_q.tolist() == [0, 4, 10]


def test_every_layer_of_a_forward_shares_one_plan():
    """The next layer's call with the same mask (or the same positions) gets the plan the first one made, the
    very tensors: attention_varlen then reads its cu_seqlens on the host once, not once per layer."""
    q = torch.randn(2, 4, 6, 8)
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    mask[1, 0, :, :3] = False  # left padding of 3 in sequence 1
    plan = integration.segment_plan(mask, None, q, q, None, True)
    assert integration.segment_plan(mask, None, q, q, None, True) is plan
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])  # two packed documents of 3 tokens
    found = [integration.document_starts(q, q, dict(position_ids=positions)) for _ in range(2)]
    assert found[0] is found[1] and found[0].tolist() == [[True, False, False, True, False, False]] * 2
    plan = integration.segment_plan(None, found[0], q, q, None, True)
    assert integration.segment_plan(None, found[1], q, q, None, True) is plan
    assert plan.cu_seqlens_q.tolist() == [0, 3, 6, 9, 12]
