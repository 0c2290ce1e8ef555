"""DeepSeek-V3 through register(): multi-head latent attention, whose queries and keys have more dims
(no-position part + rotary part, 16 + 8 = 24 here) than its values (16), in a model with a mixture of
experts.

flashtile gets value with its own head dim, unpadded, and returns o with that dim (transformers pads value
to the query's dim only for FlashAttention-2). The truth is transformers' own attention on the same
weights: eager in float64 for the float32 runs; for the float64 run, SDPA's math in float64, because
DeepSeek-V3's eager attention takes its softmax in float32 (eager in float64 is itself off by about 3e-6).
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
    deepseek_v3_config,
    max_rel_grad_error,
    token_ids,
)

LOGITS_ATOL = 2e-4  # float32 against float64: measured errors are about 2e-5 on logits of size about 10
GRAD_RTOL = 2e-4  # max |grad error| / max |grad|, per parameter
FLOAT64_ATOL = 1e-9  # float64 against SDPA's math in float64, logits and relative gradients
GREEDY = dict(do_sample=False, pad_token_id=0)
D_QK, D_V = 24, 16


@pytest.fixture(scope="module")
def name():
    return register()


def deepseek_twins(name: str, dtype=torch.float32, truth: str = "eager"):
    """(truth, ours): transformers' ``truth`` attention in float64 (SDPA for a float64 ``ours``) and ``name``
    in ``dtype``, the same weights."""
    truth = build(deepseek_v3_config(), "sdpa" if dtype == torch.float64 else truth, dtype=torch.float64)
    ours = build(deepseek_v3_config(), name, dtype=dtype)
    ours.load_state_dict({k: v.to(dtype) for k, v in truth.state_dict().items()})
    return truth, ours


def recording(monkeypatch, entry: str) -> list:
    """Record (query's, value's, o's head dims) of every call the integration makes to ``entry``."""
    calls, function = [], getattr(integration, entry)

    def record(q, k, v, *args, **kwargs):
        o = function(q, k, v, *args, **kwargs)
        calls.append((q.shape[-1], v.shape[-1], o.shape[-1]))
        return o

    monkeypatch.setattr(integration, entry, record)
    return calls


@pytest.mark.parametrize(
    "backend, dtype",
    [("reference", torch.float64), ("triton", torch.float32)],
    ids=["reference-float64", "triton-float32"],
)
def test_a_training_step_matches_with_the_values_own_head_dim(name, backend, dtype, monkeypatch):
    """Two layers (dense, then experts) on 12 tokens: logits and the gradient of every parameter; every
    attention call gets value and returns o with 16 dims, the queries' 24 untouched."""
    calls = recording(monkeypatch, "attention")
    truth, ours = deepseek_twins(name, dtype)
    ids = token_ids(2, 12)
    truth(ids, labels=ids).loss.backward()
    with use_backend(backend):
        out = ours(ids, labels=ids)
        out.loss.backward()
    float64 = dtype == torch.float64
    assert (out.logits.double() - truth(ids).logits).abs().max().item() < (FLOAT64_ATOL if float64 else LOGITS_ATOL)
    err, where = max_rel_grad_error(truth, ours)
    assert err < (FLOAT64_ATOL if float64 else GRAD_RTOL), f"{where}: {err}"
    assert calls == [(D_QK, D_V, D_V)] * 2


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_greedy_generation_with_a_kv_cache_matches_eager_token_for_token(name, backend, monkeypatch):
    """The cache holds the compressed latents; each step expands them into keys (24 dims) and values (16),
    and new tokens 2 to 5 take the decode kernel with 16-dim values."""
    calls = recording(monkeypatch, "decode_attention")
    truth, ours = deepseek_twins(name)
    prompt = token_ids(2, 6)
    expected = truth.generate(prompt, max_new_tokens=5, **GREEDY)
    with use_backend(backend):
        got = ours.generate(prompt, max_new_tokens=5, **GREEDY)
    assert got.shape == (2, 11) and torch.equal(got, expected)
    assert calls == [(D_QK, D_V, D_V)] * (4 * 2)


def test_a_padded_batch_is_one_packed_call_per_layer_and_matches_on_real_tokens(name, monkeypatch):
    """Left padding of 5 and 11 (a single real token) in one batch: each layer gathers the real tokens into
    one packed call with 16-dim values, and their logits are transformers'; then generation from the padded
    prompts. The truth is SDPA in float64: eager in float64 gives NaN with padding (test_transformers.py,
    PADDED_TRUTH, says why)."""
    calls = recording(monkeypatch, "attention_varlen")
    truth, ours = deepseek_twins(name, truth="sdpa")
    ids = token_ids(3, 12)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :5] = 0
    mask[2, :11] = 0
    with torch.no_grad(), use_backend("triton"):  # the kernels (on a CPU, the interpreter)
        got = ours(ids, attention_mask=mask).logits
        expected = truth(ids, attention_mask=mask).logits
    real = mask.bool()
    assert (got.double() - expected)[real].abs().max().item() < LOGITS_ATOL
    assert calls == [(D_QK, D_V, D_V)] * 2
    with use_backend("reference"):  # the interpreter is slow: the cache's masks on the reference tier
        new = ours.generate(ids, attention_mask=mask, max_new_tokens=5, **GREEDY)
    assert torch.equal(new, truth.generate(ids, attention_mask=mask, max_new_tokens=5, **GREEDY))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_on_the_gpu_is_as_accurate_as_eager_and_generates_its_tokens(name):
    """bf16 on the kernels with DeepSeek-V3's own head dims (192 = 128 + 64 for queries and keys, 128 for
    values), padded and unpadded, against a float32 eager truth: flashtile's largest logit error on the real
    tokens may not exceed eager's own bf16 error by more than 25 % (plus 2e-3); greedy generation gives
    eager bf16's tokens. T = 384. Every token takes both routed experts and the weights are small
    (initializer_range 0.02): a choice among experts would flip under bf16 rounding, and large hidden states
    would make eager's own bf16 error hide the attention's (test_gpt_oss.py has the numbers)."""
    sizes = dict(max_position_embeddings=512, vocab_size=512, hidden_size=256, intermediate_size=256,
                 num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, qk_nope_head_dim=128,
                 qk_rope_head_dim=64, v_head_dim=128, initializer_range=0.02, num_hidden_layers=3,
                 n_routed_experts=2, num_experts_per_tok=2)  # fmt: skip
    config = deepseek_v3_config(**sizes)
    truth = build(config, "eager").cuda()
    ids = torch.randint(1, 512, (2, 384), generator=torch.Generator().manual_seed(1)).cuda()
    mask = torch.ones_like(ids)
    mask[0, :100] = 0
    errors, tokens = bf16_logit_errors(truth, config, (name, "eager"), ids, mask, generate_tokens=8)
    for padded in (False, True):
        assert errors[name, padded] <= 1.25 * errors["eager", padded] + 2e-3, errors
    assert torch.equal(tokens[name], tokens["eager"])
