"""flashtile inside Hugging Face transformers: register(), then the same model on eager attention and on
flashtile must agree (logits, every parameter gradient, greedy generation with a KV cache, padded batches),
and what flashtile cannot compute must raise rather than be ignored.

The truth is transformers' own eager attention (matmul + softmax, no flashtile) in float64 with the same
weights; flashtile runs in float32 on the reference tier and on the Triton kernels (through the
interpreter on a CPU).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

import flashtile.integrations.transformers as integration  # noqa: E402
from flashtile.api import use_backend  # noqa: E402
from flashtile.integrations.transformers import DEFAULT_NAME, register  # noqa: E402
from tests.integrations._hf_models import (  # noqa: E402
    build,
    cache_argument,
    llama_config,
    max_rel_grad_error,
    qwen2_config,
    token_ids,
    twins,
)

BACKENDS = ["reference", "triton"]
LOGITS_ATOL = 2e-4  # float32 against float64: measured errors are about 1e-5 on logits of size about 10
GRAD_RTOL = 2e-4  # max |grad error| / max |grad|, per parameter
# PADDED_TRUTH: with padding, the truth is eager in float32. In float64, transformers' eager mask (score +
# finfo(float64).min) overflows to -inf, a padding row's softmax is NaN, and 0 * NaN carries it into the
# real tokens of the next layer: the truth itself would be NaN.


@pytest.fixture(scope="module")
def name():
    return register()


def test_register_returns_the_name_and_is_idempotent():
    first = register()
    assert first == DEFAULT_NAME and register() == first
    assert AttentionInterface._global_mapping[first] is integration.flashtile_attention_forward
    assert first in AttentionMaskInterface._global_mapping


@pytest.mark.parametrize("bad", ["flashtile", "my_FLASH_attention", "eager", "paged|ftile", ""])
def test_register_refuses_names_transformers_would_misread(bad):
    with pytest.raises(ValueError, match="flash"):
        register(bad)


def test_register_refuses_a_name_taken_by_another_implementation():
    with pytest.raises(ValueError, match="already registered"):
        register("sdpa")


def test_the_flash_name_trap_is_real():
    """Control for the name check: the same function registered under a name containing "flash", without
    register(), makes transformers look for a kernel package and fail to build the model."""
    trap = "flashtile_trap"
    AttentionInterface.register(trap, integration.flashtile_attention_forward)
    try:
        with pytest.raises((ValueError, ImportError)):
            build(llama_config(), trap)
    finally:
        del AttentionInterface._global_mapping[trap]


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_and_every_parameter_gradient_match_eager_with_gqa(name, backend):
    truth, ours = twins(llama_config(num_key_value_heads=2), name)  # 4 query heads share 2 K/V heads
    ids = token_ids(2, 24)
    truth(ids, labels=ids).loss.backward()
    with use_backend(backend):
        out = ours(ids, labels=ids)
        out.loss.backward()
    expected = truth(ids).logits
    assert (out.logits.double() - expected).abs().max().item() < LOGITS_ATOL
    err, where = max_rel_grad_error(truth, ours)
    assert err < GRAD_RTOL, f"{where}: {err}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_generation_with_a_kv_cache_matches_eager_token_for_token(name, backend):
    truth, ours = twins(llama_config(), name)
    prompt = token_ids(2, 11)  # 6 steps on the cache, from 12 to 17 keys: past the interpreter's 16-key tile
    expected = truth.generate(prompt, max_new_tokens=7, do_sample=False, pad_token_id=0)
    with use_backend(backend):
        got = ours.generate(prompt, max_new_tokens=7, do_sample=False, pad_token_id=0)
    assert got.shape == (2, 18) and torch.equal(got, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_several_new_tokens_after_a_cache_align_lower_right(name, backend):
    """A chunked prefill: 9 tokens, then 5 more against the cache (Tq = 5 < Tk = 14), with and without
    left padding. Upper-left alignment would let the first new token see only keys 0 ... 0."""
    from transformers import DynamicCache

    truth, ours = twins(llama_config(), name, truth_dtype=torch.float32)  # see PADDED_TRUTH
    ids = token_ids(2, 14)
    for left_padding in (0, 4):
        mask = torch.ones(2, 14, dtype=torch.long)
        mask[0, :left_padding] = 0
        logits = []
        for model in (truth, ours):
            with torch.no_grad(), use_backend(backend):
                cache = DynamicCache(config=model.config)
                model(ids[:, :9], attention_mask=mask[:, :9], **{cache_argument(model): cache})
                logits.append(model(ids[:, 9:], attention_mask=mask, **{cache_argument(model): cache}).logits)
        assert (logits[0] - logits[1]).abs().max().item() < LOGITS_ATOL


@pytest.mark.parametrize("padded", [False, True])
def test_generation_with_a_static_cache_matches_eager(name, padded):
    """A static cache is longer than the sequence: slots past it are empty and must not be attended to."""
    truth, ours = twins(llama_config(), name, truth_dtype=torch.float32)  # see PADDED_TRUTH
    ids, mask = token_ids(2, 8), torch.ones(2, 8, dtype=torch.long)
    if padded:
        mask[0, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    assert torch.equal(ours.generate(ids, **kwargs), truth.generate(ids, **kwargs))


def test_one_new_token_without_a_mask_runs_the_decode_kernel(name, monkeypatch):
    calls = []
    decode = integration.decode_attention
    monkeypatch.setattr(integration, "decode_attention", lambda *a, **k: calls.append(1) or decode(*a, **k))
    _, ours = twins(llama_config(), name)
    ours.generate(token_ids(1, 6), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert len(calls) == 2 * ours.config.num_hidden_layers  # new tokens 2 and 3; the prompt is one call


@pytest.mark.parametrize("backend", BACKENDS)
def test_left_padded_batch_matches_eager_on_real_tokens_and_generates_the_same(name, backend):
    truth, ours = twins(llama_config(), name, truth_dtype=torch.float32)  # float64 eager: see PADDED_TRUTH
    ids = token_ids(3, 12)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :5] = 0  # left padding of 5
    mask[2, :11] = 0  # a single real token
    with torch.no_grad(), use_backend(backend):
        got = ours(ids, attention_mask=mask).logits
        expected = truth(ids, attention_mask=mask).logits
        real = mask.bool()
        assert (got.double() - expected)[real].abs().max().item() < LOGITS_ATOL
        new = ours.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(new, truth.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0))


def test_right_padded_batch_gives_each_sequence_what_it_gets_alone(name):
    """A second truth for padding: a sequence's logits do not depend on what it is batched with."""
    truth, ours = twins(llama_config(), name)
    ids = token_ids(2, 16)
    lengths = [16, 9]
    mask = torch.zeros(2, 16, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    ids_grad_free = ids.clone()
    out = ours(ids_grad_free, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    out.loss.backward()  # padded training step: gradients flow through the per-sequence path
    with torch.no_grad():
        for b, n in enumerate(lengths):
            alone = truth(ids[b : b + 1, :n]).logits[0]
            assert (out.logits[b, :n].double() - alone).abs().max().item() < LOGITS_ATOL


def test_without_the_mask_function_padding_would_be_silently_ignored(name):
    """Control for register()'s second half: the attention function alone, under a name with no mask
    function, gets attention_mask=None and its left-padded logits are wrong on the real tokens."""
    bare = "ftile_without_mask"
    AttentionInterface.register(bare, integration.flashtile_attention_forward)
    try:
        truth, ours = twins(llama_config(), bare, truth_dtype=torch.float32)  # see PADDED_TRUTH
        ids, mask = token_ids(2, 12), torch.ones(2, 12, dtype=torch.long)
        mask[0, :5] = 0
        with torch.no_grad():
            wrong = ours(ids, attention_mask=mask).logits.double() - truth(ids, attention_mask=mask).logits
        assert wrong[0, 5:].abs().max().item() > 100 * LOGITS_ATOL  # the padded sequence's real tokens
        assert wrong[1].abs().max().item() < LOGITS_ATOL  # the unpadded one is right
    finally:
        del AttentionInterface._global_mapping[bare]


def test_qwen2_with_multi_head_attention_matches_eager(name):
    """Another family (biases on q, k, v) with H_kv = H."""
    truth, ours = twins(qwen2_config(num_key_value_heads=4), name)
    ids = token_ids(2, 20)
    truth(ids, labels=ids).loss.backward()
    out = ours(ids, labels=ids)
    out.loss.backward()
    assert (out.logits.double() - truth(ids).logits).abs().max().item() < LOGITS_ATOL
    err, where = max_rel_grad_error(truth, ours)
    assert err < GRAD_RTOL, f"{where}: {err}"
    prompt = token_ids(1, 6)
    expected = truth.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0), expected)


def test_set_attn_implementation_switches_an_existing_model(name):
    truth = build(llama_config(), "eager")
    ids = token_ids(1, 10)
    with torch.no_grad():
        expected = truth(ids).logits
        truth.set_attn_implementation(name)
        assert truth.config._attn_implementation == name
        assert (truth(ids).logits - expected).abs().max().item() < LOGITS_ATOL


def test_right_padding_during_generation_is_refused(name):
    _, ours = twins(llama_config(), name)
    ids, mask = token_ids(2, 8), torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    with pytest.raises(ValueError, match="pad on the left"):
        ours.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_attention_dropout_in_training_is_refused(name):
    ours = build(llama_config(attention_dropout=0.1), name)
    ours.train()
    with pytest.raises(ValueError, match="dropout"):
        ours(token_ids(1, 8))
    ours.eval()
    ours(token_ids(1, 8))  # evaluation passes dropout=0.0: allowed
