"""gpt-oss through register(): learnable attention sinks on every layer, sliding-window and full layers
alternating, grouped-query attention.

The truth is transformers' own eager attention for gpt-oss (matmul, its mask, the sinks appended as one more
column of the scaled scores, softmax, the column dropped), in float64. Every sink is set to a random value
of a size that moves the logits far beyond the tolerance (the control: the same eager model without sinks
is far from the truth), so a flashtile that dropped the sinks, or scaled them as a score, would fail.
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
    gpt_oss_config,
    max_rel_grad_error,
    token_ids,
)

LOGITS_ATOL = 2e-4  # float32 against float64: measured errors are about 2e-5 on logits of size about 10
FLOAT64_ATOL = 1e-9  # float64 against float64, logits and relative gradients: measured 0 and 2e-15
GRAD_RTOL = 2e-4  # max |grad error| / max |grad|, per parameter
FAR = 100 * LOGITS_ATOL  # what a control must miss the truth by
GREEDY = dict(do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def name():
    return register()


def with_sinks(model, seed: int = 2):
    """Every layer's sinks drawn from N(0, 1.5^2), the same for any dtype of ``model``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            sinks = layer.self_attn.sinks
            sinks.copy_(1.5 * torch.randn(sinks.shape, generator=gen, dtype=torch.float64))
    return model


def gpt_oss_twins(name: str, dtype=torch.float32, config=None):
    """(truth, ours): eager in float64 and ``name`` in ``dtype``, the same weights and nonzero sinks."""
    config = config or gpt_oss_config()
    truth = with_sinks(build(config, "eager", dtype=torch.float64))
    ours = build(config, name, dtype=dtype)
    ours.load_state_dict({k: v.to(dtype) for k, v in truth.state_dict().items()})
    return truth, ours


def test_the_layer_passes_its_sinks_in_the_units_of_the_scaled_score(name):
    """One attention call, flashtile against gpt-oss's own eager attention function, in float64, with a
    scale far from 1/sqrt(D): a sink multiplied by the scale (or left out) would be off by far more."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Module()
    layer.num_key_value_groups, layer.is_causal = 2, True
    layer.sinks = torch.nn.Parameter(torch.tensor([2.0, -1.0, 0.5, 3.0], dtype=torch.float64))
    q = torch.randn(2, 4, 7, 16, generator=gen, dtype=torch.float64)
    k, v = torch.randn(2, 2, 2, 7, 16, generator=gen, dtype=torch.float64)
    mask = torch.full((7, 7), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    scale = 0.7
    expected, _ = eager_attention_forward(layer, q, k, v, mask, scaling=scale)
    got, _ = integration.flashtile_attention_forward(layer, q, k, v, None, scaling=scale, s_aux=layer.sinks)
    assert (got - expected).abs().max().item() < 1e-12
    without, _ = integration.flashtile_attention_forward(layer, q, k, v, None, scaling=scale)
    assert (without - expected).abs().max().item() > 0.1  # control: the sinks matter here


@pytest.mark.parametrize(
    "backend, dtype",
    [("reference", torch.float64), ("triton", torch.float32)],
    ids=["reference-float64", "triton-float32"],
)
def test_a_training_step_matches_eager_logits_and_every_gradient(name, backend, dtype):
    """Two layers (windowed of 4 keys, then full) on 12 tokens: logits and the gradient of every parameter,
    the sinks' included."""
    truth, ours = gpt_oss_twins(name, dtype)
    ids = token_ids(2, 12)
    truth(ids, labels=ids).loss.backward()
    with use_backend(backend):
        out = ours(ids, labels=ids)
        out.loss.backward()
    float64 = dtype == torch.float64
    assert (out.logits.double() - truth(ids).logits).abs().max().item() < (FLOAT64_ATOL if float64 else LOGITS_ATOL)
    err, where = max_rel_grad_error(truth, ours)
    assert err < (FLOAT64_ATOL if float64 else GRAD_RTOL), f"{where}: {err}"
    sinks = [p.grad for n, p in ours.named_parameters() if n.endswith("sinks")]
    assert len(sinks) == 2 and all(bool(g.abs().min() > 0) for g in sinks)


def test_the_sinks_and_the_window_matter_in_this_model():
    """The control for the tests above: eager without the sinks (all -inf), or without the window (4 keys
    on layer 0), is far from eager with them on the same 12 tokens, so a flashtile that dropped either would
    fail."""
    truth = with_sinks(build(gpt_oss_config(), "eager", dtype=torch.float64))
    ids = token_ids(2, 12)
    with torch.no_grad():
        expected = truth(ids).logits
        full = build(gpt_oss_config(sliding_window=12), "eager", dtype=torch.float64)  # 12 keys: no window
        full.load_state_dict(truth.state_dict())
        assert (full(ids).logits - expected).abs().max().item() > FAR
        for layer in truth.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
        assert (truth(ids).logits - expected).abs().max().item() > FAR


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_greedy_generation_with_a_kv_cache_matches_eager_token_for_token(name, backend, monkeypatch):
    """A prompt of 6 tokens and 5 new ones: the windowed layer's cache runs past its 4 keys. New tokens 2
    to 5 take the decode kernel, with the sinks."""
    calls = []
    decode = integration.decode_attention
    monkeypatch.setattr(integration, "decode_attention", lambda *a, **k: calls.append(k) or decode(*a, **k))
    truth, ours = gpt_oss_twins(name)
    prompt = token_ids(2, 6)
    expected = truth.generate(prompt, max_new_tokens=5, **GREEDY)
    with use_backend(backend):
        got = ours.generate(prompt, max_new_tokens=5, **GREEDY)
    assert got.shape == (2, 11) and torch.equal(got, expected)
    assert len(calls) == 4 * 2 and all(call["sinks"] is ours.model.layers[0].self_attn.sinks for call in calls[::2])


def test_a_padded_batch_is_one_call_per_layer_and_trains_and_generates_as_eager(name, monkeypatch):
    """Left padding of 5, right padding of 3, a single real token and no padding in one batch: each layer
    runs one packed call with the sinks; a training step's logits on the real tokens and every gradient
    (the sinks' included) are eager's; then generation from the left-padded prompts. Eager in float64 is a
    truth here even with padding (unlike Llama's, test_transformers.py, PADDED_TRUTH): the sink's column
    keeps a padding row's softmax finite."""
    truth, ours = gpt_oss_twins(name)
    ids = token_ids(4, 12)
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[0, :5] = 0
    mask[1, 9:] = 0
    mask[2, :11] = 0
    real = mask.bool()
    # a token is a label only if it and the one before it are real (test_transformers_windows.py says why)
    labels = ids.masked_fill(~real, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(~real[:, :-1], -100)
    calls = []
    varlen = integration.attention_varlen
    monkeypatch.setattr(integration, "attention_varlen", lambda *a, **k: calls.append(k) or varlen(*a, **k))
    expected = truth(ids, attention_mask=mask, labels=labels)
    expected.loss.backward()
    with use_backend("triton"):  # the kernels (on a CPU, the interpreter)
        got = ours(ids, attention_mask=mask, labels=labels)
        got.loss.backward()
    assert (got.logits.double() - expected.logits)[real].abs().max().item() < LOGITS_ATOL
    err, where = max_rel_grad_error(truth, ours)
    assert err < GRAD_RTOL, f"{where}: {err}"
    assert len(calls) == 2 and all(call["sinks"] is not None for call in calls)
    left = [0, 2, 3]  # right padding cannot generate (test_transformers.py)
    with use_backend("reference"):  # the interpreter is slow: the cache's masks on the reference tier
        new = ours.generate(ids[left], attention_mask=mask[left], max_new_tokens=5, **GREEDY)
    assert torch.equal(new, truth.generate(ids[left], attention_mask=mask[left], max_new_tokens=5, **GREEDY))


def test_sinks_that_are_not_one_per_head_are_refused():
    """Per-token sinks (B, H, Tq, 1), as some models compute them from the hidden states, are not flashtile's
    per-head sinks: refused, naming the argument, rather than broadcast into something else."""
    layer = torch.nn.Module()
    q, k, v = torch.randn(3, 1, 4, 6, 8)
    with pytest.raises(ValueError, match=r"sinks of shape \(4,\)"):
        integration.flashtile_attention_forward(layer, q, k, v, None, sinks=torch.zeros(1, 4, 6, 1))
    with pytest.raises(ValueError, match=r"s_aux of shape \(4,\)"):
        integration.flashtile_attention_forward(layer, q, k, v, None, s_aux=torch.zeros(2))
    with pytest.raises(ValueError, match="both"):
        integration.flashtile_attention_forward(layer, q, k, v, None, s_aux=torch.zeros(4), sinks=torch.zeros(4))


def test_the_sinks_reach_flashtile_as_the_layers_own_tensor():
    """No copy on the way: the gradient of the call reaches the parameter (float32 sinks with float64
    queries are taken as they are too; bf16 sinks with float32 queries are cast to float32)."""
    q = torch.randn(1, 4, 6, 8)
    sinks = torch.randn(4, requires_grad=True)
    assert integration.layer_sinks(dict(s_aux=sinks), q) is sinks
    assert integration.layer_sinks(dict(s_aux=sinks), q.double()) is sinks
    assert integration.layer_sinks(dict(s_aux=sinks.bfloat16()), q).dtype == torch.float32
    assert integration.layer_sinks(dict(s_aux=None), q) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_on_the_gpu_is_as_accurate_as_eager_and_generates_its_tokens(name):
    """bf16 on the kernels, padded and unpadded, against a float32 eager truth: flashtile's largest logit
    error on the real tokens may not exceed eager's own bf16 error by more than 25 % (plus 2e-3); greedy
    generation gives eager bf16's tokens. T = 384, windows of 128 keys on alternating layers. Every token
    takes both experts, and the weights are small (initializer_range 0.02): with a choice among experts,
    or hidden states of size 30, eager's own bf16 logits were off by 0.9 to 6.6 on a CPU, which would hide
    any attention error; here by about 0.014, with the sinks moving the logits by 0.7 (the control)."""
    sizes = dict(max_position_embeddings=512, vocab_size=512, hidden_size=256, intermediate_size=256,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=64, initializer_range=0.02,
                 num_hidden_layers=4, num_local_experts=2, num_experts_per_tok=2)  # fmt: skip
    config = gpt_oss_config(sliding_window=128, **sizes)
    truth = with_sinks(build(config, "eager")).cuda()
    ids = torch.randint(1, 512, (2, 384), generator=torch.Generator().manual_seed(1)).cuda()
    mask = torch.ones_like(ids)
    mask[0, :100] = 0
    errors, tokens = bf16_logit_errors(truth, config, (name, "eager"), ids, mask, generate_tokens=8)
    for padded in (False, True):
        assert errors[name, padded] <= 1.25 * errors["eager", padded] + 2e-3, errors
    assert torch.equal(tokens[name], tokens["eager"])
    with torch.no_grad():  # control: the sinks matter here far beyond bf16 rounding
        expected = truth(ids).logits
        for layer in truth.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
        control = (truth(ids).logits - expected).abs().max().item()
    assert control > 4 * max(errors.values()), (control, errors)


def test_packed_documents_with_cu_seq_lens_stay_apart_under_torch_compile(name):
    """Three documents packed in one row, their boundaries given as cu_seq_lens (as transformers' collator
    with return_flash_attn_kwargs=True gives them): eagerly and compiled, each document's logits are those
    it gets alone. The control: the same row read as one document differs from them."""
    _, ours = gpt_oss_twins(name, config=gpt_oss_config(sliding_window=3))
    ids = token_ids(1, 14, seed=4)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6, 7]])
    cu = torch.tensor([0, 5, 6, 14], dtype=torch.int32)
    packed = dict(position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=8, max_length_k=8,
                  use_cache=False)  # fmt: skip
    torch._dynamo.reset()
    with torch.no_grad():
        alone = torch.cat([ours(ids[:, a:b], use_cache=False).logits for a, b in ((0, 5), (5, 6), (6, 14))], 1)
        eager = ours(ids, **packed).logits
        compiled = torch.compile(ours, backend="aot_eager")(ids, **packed).logits
        one_document = ours(ids, use_cache=False).logits
    torch.testing.assert_close(eager, alone, rtol=0, atol=LOGITS_ATOL)
    torch.testing.assert_close(compiled, alone, rtol=0, atol=LOGITS_ATOL)
    assert (one_document - alone).abs().max() > FAR


def test_output_attentions_is_refused_rather_than_answered_with_nothing(name):
    _, ours = gpt_oss_twins(name)
    with torch.no_grad(), pytest.raises(ValueError, match="output_attentions=True cannot be answered"):
        ours(token_ids(2, 8), output_attentions=True)
