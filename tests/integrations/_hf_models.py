"""Tiny transformers models with random weights (no downloads) for the integration tests.

``twins(config, name)`` builds the same weights twice: one model on transformers' own eager attention
(the truth: its attention is matmul + softmax, independent of flashtile) and one on ``name``. Each model
gets its own copy of the config: ``from_config`` writes the attention implementation into the config
object it is given, so two models built from one config object would both end up on the last one.
"""

from __future__ import annotations

import copy
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 97
# initializer_range 0.3 (transformers' default is 0.02) makes the attention weights far from uniform, so a
# wrong mask or a wrong alignment changes the logits by far more than the tolerance
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, initializer_range=0.3)  # fmt: skip


def llama_config(num_key_value_heads: int = 2, **overrides):
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY, "num_key_value_heads": num_key_value_heads, **overrides})


def qwen2_config(num_key_value_heads: int = 4, **overrides):
    from transformers import Qwen2Config

    return Qwen2Config(**{**TINY, "num_key_value_heads": num_key_value_heads, **overrides})


def mistral_config(sliding_window: int = 5, num_key_value_heads: int = 2, **overrides):
    """A Mistral: every layer windowed, W keys back (the query's own included)."""
    from transformers import MistralConfig

    return MistralConfig(**{**TINY, "num_key_value_heads": num_key_value_heads, "sliding_window": sliding_window,
                            **overrides})  # fmt: skip


def qwen2_window_config(sliding_window: int = 5, **overrides):
    """A Qwen2 with use_sliding_window: layer 0 full (max_window_layers = 1), layer 1 windowed."""
    return qwen2_config(num_key_value_heads=2, use_sliding_window=True, sliding_window=sliding_window,
                        max_window_layers=1, **overrides)  # fmt: skip


def gemma2_config(sliding_window: int = 5, softcap: float = 5.0, **overrides):
    """A Gemma-2: windowed and global layers alternating, soft-capped scores, τ = query_pre_attn_scalar^-1/2
    (24^-1/2, not the head dim's 16^-1/2), so a wrong scale, cap or window shows in the logits."""
    from transformers import Gemma2Config

    return Gemma2Config(**{**TINY, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": sliding_window,
                           "attn_logit_softcapping": softcap, "query_pre_attn_scalar": 24, **overrides})  # fmt: skip


def gpt_oss_config(sliding_window: int = 4, **overrides):
    """A gpt-oss: sliding-window and full layers alternating, learnable sinks, GQA (4 query heads on 2 K/V
    heads), a mixture of 4 tiny experts (2 per token). Plain RoPE: the tiny context has nothing for YaRN to
    stretch."""
    from transformers import GptOssConfig

    layers = overrides.pop("num_hidden_layers", 2)
    kinds = ["sliding_attention", "full_attention"] * layers
    return GptOssConfig(**{**TINY, "intermediate_size": 32, "num_hidden_layers": layers,
                           "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
                           "num_experts_per_tok": 2, "sliding_window": sliding_window,
                           "layer_types": kinds[:layers],
                           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                           **overrides})  # fmt: skip


def deepseek_v3_config(**overrides):
    """A DeepSeek-V3: multi-head latent attention whose queries and keys have 16 + 8 = 24 dims (no position
    and rotary parts) and whose values have 16; layer 0 dense, layer 1 a mixture of 4 tiny routed experts
    (2 per token) and one shared expert."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**{**TINY, "intermediate_size": 64, "moe_intermediate_size": 16,
                               "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
                               "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
                               "first_k_dense_replace": 1, "q_lora_rank": None, "kv_lora_rank": 16,
                               "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                               **overrides})  # fmt: skip


def build(config, attn_implementation: str, seed: int = 0, dtype=torch.float32):
    """The model of ``config`` on ``attn_implementation``, its weights drawn from ``seed``. Mixtures of experts
    run their experts one by one (``experts_implementation="eager"``): the grouped matmul has no float64."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn_implementation,
                                             experts_implementation="eager")  # fmt: skip
    return model.to(dtype)


def twins(config, name: str, truth_dtype=torch.float64):
    """(truth, ours): eager in ``truth_dtype`` and ``name`` in float32, with the same weights."""
    truth = build(config, "eager", dtype=truth_dtype)
    ours = build(config, name)
    ours.load_state_dict({k: v.float() for k, v in truth.state_dict().items()})
    return truth, ours


def cache_argument(model) -> str:
    """The forward's name for a cache: transformers renamed past_key_values to cache (the CPU machine has
    5.24, the GPU machine 5.17, which knows only past_key_values and would silently ignore cache=)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def token_ids(B: int, T: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (B, T), generator=gen)


def max_rel_grad_error(truth, ours) -> tuple[float, str]:
    """(error, name): the largest max |ours' grad - truth's grad| / max |truth's grad| over the parameters, in
    float64, and the parameter it is at; the two models' parameters are paired in order."""
    worst = (0.0, "")
    for (param_name, p), q in zip(truth.named_parameters(), ours.parameters()):
        err = ((q.grad.double() - p.grad.double()).abs().max() / p.grad.abs().max().clamp_min(1e-30)).item()
        worst = max(worst, (err, param_name))
    return worst


def bf16_logit_errors(truth, config, implementations, ids, mask, generate_tokens: int = 0) -> tuple[dict, dict]:
    """Each implementation's model in bf16 (``truth``'s weights, on its device) against ``truth``'s logits:
    ({(implementation, padded): largest |error| over the real tokens}, {implementation: greedy tokens}),
    padded meaning with ``mask`` as the attention mask. With ``generate_tokens``, each also generates that
    many tokens greedily from the first 40 of ``ids``, row 0 left-padded by 10."""
    device = next(truth.parameters()).device
    errors, tokens = {}, {}
    for implementation in implementations:
        model = build(copy.deepcopy(config), implementation, dtype=torch.bfloat16).to(device)
        model.load_state_dict(truth.state_dict())
        for padded in (False, True):
            inputs = dict(attention_mask=mask) if padded else {}
            with torch.no_grad():
                got = model(ids, **inputs).logits.float()
                expected = truth(ids, **inputs).logits
            real = mask.bool() if padded else torch.ones_like(mask, dtype=torch.bool)
            errors[implementation, padded] = (got - expected)[real].abs().max().item()
        if generate_tokens:
            prompt_mask = torch.ones_like(ids[:, :40])
            prompt_mask[0, :10] = 0  # left padding: generation from a padded batch
            tokens[implementation] = model.generate(ids[:, :40], attention_mask=prompt_mask,
                                                    max_new_tokens=generate_tokens, do_sample=False,
                                                    pad_token_id=0)  # fmt: skip
    return errors, tokens
