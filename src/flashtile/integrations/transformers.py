"""flashtile as an attention implementation of Hugging Face transformers (5.x).

    from flashtile.integrations.transformers import register
    name = register()                                   # "ftile"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)
    model.set_attn_implementation(name)                 # or switch a model you already have

What it supports:

* causal language models (Llama, Mistral, Qwen2, ... : any model whose attention layers call
  ``ALL_ATTENTION_FUNCTIONS``): training (reverse-mode autograd), evaluation, and generation with a KV
  cache (dynamic or static), the new tokens aligned lower-right to the cache; one new token without a
  mask and without gradients runs ``flashtile.decode_attention``;
* grouped-query attention without repeating K/V (``enable_gqa=True``); inputs as transformers passes
  them, (B, H, T, D) views of (B, T, H, D) projections;
* padded batches (left or right padding): each sequence's real tokens run on their own, so the answer on
  the real tokens is exact; padding rows come out as zeros.

What it refuses, with an error that names the limitation (never a silently ignored mask): a mask that is
not "causal, restricted to one contiguous run of real keys per sequence" (sliding windows, packed
sequences, block or prefix masks, additive biases, per-head masks), a mask on a non-causal layer,
attention dropout, logit soft-capping, attention sinks and position biases.

Two traps this module handles for its users:

* transformers treats every attention-implementation name that contains "flash" as a request for a
  FlashAttention kernel package, and one with "/" or ":" as a Hub kernel repository, and fails to load
  it: ``register`` refuses such names;
* a custom attention function receives ``attention_mask=None`` for a padded batch unless a mask function
  is registered under the same name (``AttentionMaskInterface``): ``register`` registers one.

Measured status: the CPU tests in tests/integrations compare logits, every parameter gradient and greedy
generation with transformers' eager attention on tiny Llama and Qwen2 models. A padded batch takes one
attention call per sequence (and reads the mask on the host), so it is slower than one batched call and
is not ``torch.compile`` fullgraph-clean; an unpadded batch is a single call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..api import attention
from ..decode import decode_attention

DEFAULT_NAME = "ftile"


# --8<-- [start:register]
def check_name(name) -> str:
    """A name transformers will take as a plain registered implementation, or a ValueError naming ``name``.

    transformers reads any attention implementation whose name contains "flash" as a request for a
    FlashAttention kernel package, and one with "/" or ":" as a kernel repository on the Hub
    ("org/name" or "org/name:function"): either way it goes looking for a package and fails to load it
    instead of calling the registered function. "eager" and names with "|" are reserved.
    """
    if not isinstance(name, str) or not name or "flash" in name.lower() or name == "eager" or "|" in name:
        raise ValueError(
            f"cannot register flashtile as name={name!r}: transformers reads any attention implementation whose "
            "name contains 'flash' as a request for a FlashAttention kernel package and fails to load it; 'eager' "
            f"and names with '|' are reserved too. Use another name, e.g. {DEFAULT_NAME!r}"
        )
    if "/" in name or ":" in name:
        raise ValueError(
            f"cannot register flashtile as name={name!r}: transformers reads a name with '/' or ':' as a kernel "
            f"repository on the Hub ('org/name' or 'org/name:function') and tries to download it; use a name "
            f"without '/' and ':', e.g. {DEFAULT_NAME!r}"
        )
    return name


def register(name: str = DEFAULT_NAME) -> str:
    """Register flashtile with transformers under ``name``; return the name. Idempotent.

    Registers two things under the same name: the attention function (``AttentionInterface``) and a mask
    function (``AttentionMaskInterface``), without which the model would pass ``attention_mask=None``
    for a padded batch. Raises ValueError for a name containing "flash" (transformers would look for a
    FlashAttention kernel package), with '/' or ':' (a Hub kernel repository, "org/name:function"), or a
    name already taken by another implementation.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as exc:
        raise ImportError("flashtile.integrations.transformers needs transformers: pip install transformers") from exc
    check_name(name)
    for interface, function in ((AttentionInterface, flashtile_attention_forward), (AttentionMaskInterface, sdpa_mask)):
        taken = interface._global_mapping.get(name)
        if taken is not None and taken is not function:
            raise ValueError(f"{name!r} is already registered in transformers' {interface.__name__} as {taken!r}")
    AttentionInterface.register(name, flashtile_attention_forward)
    # sdpa's mask: None when the batch is plain causal (no padding), else a (B, 1, Tq, Tk) bool mask
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
# --8<-- [end:register]


# --8<-- [start:attention_forward]
def flashtile_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # (B, H, Tq, D), a view of the (B, Tq, H, D) projection
    key: torch.Tensor,  # (B, H_kv, Tk, D): the whole cache so far, the new tokens last
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # None, or (B, 1, Tq, Tk): True (or 0.0) where a key may be seen
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function transformers calls in every attention layer; returns (o (B, Tq, H, D), None)."""
    refuse_unsupported(module, key, dropout, kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    gqa = query.shape[1] != key.shape[1]
    Tq, Tk = query.shape[2], key.shape[2]
    if attention_mask is not None:  # padding, or new tokens after a cache: the mask says where each row sits
        o = attention_per_sequence(query, key, value, allowed_keys(attention_mask, query, key), causal, scaling, gqa)
    elif Tq == 1 and not (torch.is_grad_enabled() and query.requires_grad):
        o = decode_attention(query, key, value, scale=scaling)  # one new token sees every cached key
    else:  # sdpa's mask function skips the mask only for Tq == 1, Tq == Tk, or an empty cache (rows 0 ... Tq-1)
        causal = causal and Tq > 1
        if causal and Tk > Tq:  # an empty static cache: slots Tq ... Tk-1 hold no token yet
            key, value = key[:, :, :Tq], value[:, :, :Tq]
        o = attention(query, key, value, is_causal=causal, scale=scaling, enable_gqa=gqa)
    # (B, Tq, H, D), as the model's reshape expects. flashtile.attention lays o out like the model's query
    # view (a transposed (B, T, H, D) projection), so after it this is contiguous already: no copy
    return o.transpose(1, 2).contiguous(), None
# --8<-- [end:attention_forward]


def refuse_unsupported(module, key: torch.Tensor, dropout: float, kwargs: dict) -> None:
    """Raise for what flashtile cannot compute, rather than compute something else."""
    if dropout:
        raise ValueError(
            f"flashtile has no attention dropout, but this layer asks for dropout={dropout} (the config's "
            "attention_dropout, in training mode): set attention_dropout=0.0 or use attn_implementation='sdpa'"
        )
    for option in ("softcap", "s_aux", "sinks", "position_bias"):
        if kwargs.get(option) is not None:
            raise ValueError(f"flashtile does not support {option!r} in attention; use attn_implementation='sdpa'")
    window = kwargs.get("sliding_window")
    if window is not None and key.shape[2] > window:
        raise ValueError(
            f"flashtile has no sliding-window attention: this layer has a window of {window} keys and "
            f"{key.shape[2]} keys to attend to; use attn_implementation='sdpa'"
        )


def allowed_keys(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """(B, Tq, Tk) bool, True where a key may be seen, from transformers' (B, 1, Tq, Tk) bool or 0/-inf mask."""
    B, _, Tq, _ = query.shape
    Tk = key.shape[2]
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-2:] != (Tq, Tk) or mask.shape[0] not in (1, B):
        raise ValueError(
            f"flashtile takes a (B, 1, Tq, Tk) = ({B}, 1, {Tq}, {Tk}) padding mask, got shape {tuple(mask.shape)} "
            "(per-head and other shapes are not supported); use attn_implementation='sdpa'"
        )
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(
            f"attention_mask must be a bool or floating-point (B, 1, Tq, Tk) mask (True or 0.0 where a key may be "
            f"seen), got dtype {str(mask.dtype).replace('torch.', '')}: an integer mask is ambiguous (1 = keep, or "
            "an additive 0 / large negative?); convert it with mask.bool() or pass transformers' own mask"
        )
    if mask.dtype == torch.bool:
        allowed = mask[:, 0]
    else:  # additive: 0 where seen, a huge negative number (or -inf) where not; anything else is a bias
        allowed = mask[:, 0] == 0
        blocked = mask[:, 0] <= torch.finfo(mask.dtype).min / 2
        if not bool((allowed | blocked).all()):
            raise ValueError("flashtile cannot add a bias to the scores (this float mask is not 0/-inf); use 'sdpa'")
    return allowed.expand(B, Tq, Tk)


# --8<-- [start:per_sequence]
def attention_per_sequence(query, key, value, allowed, causal: bool, scale, gqa: bool) -> torch.Tensor:
    """A masked batch: each sequence's real keys are one run [start, end); one call per distinct run.

    The mask must be exactly "causal, aligned so that query i sits at key position i + offset, and only
    keys in [start_b, end_b)": left padding (start_b > 0), right padding (end_b < Tk), or both. Anything
    else raises. Query rows that are padding (outside [start_b, end_b)) come out as zeros.
    """
    B, H, Tq, D = query.shape
    Tk = key.shape[2]
    if not causal:
        raise ValueError("flashtile supports padding masks on causal layers only; use attn_implementation='sdpa'")
    seen = allowed.any(dim=1)  # (B, Tk): keys that some query of the sequence may see
    real = seen.any(dim=1)
    start = torch.where(real, seen.int().argmax(dim=1), 0)  # first real key
    end = torch.where(real, Tk - seen.flip(1).int().argmax(dim=1), 0)  # one past the last real key
    j = torch.arange(Tk, device=query.device)
    in_run = (j >= start[:, None, None]) & (j < end[:, None, None])  # (B, 1, Tk)
    # the offset puts the last query on the last real key (a static cache has empty slots after it); with
    # right padding and no cache, rows sit at keys 0 ... Tq-1 (offset Tk - Tq = 0)
    for offset in dict.fromkeys((int(end.max()) - Tq, Tk - Tq)):
        i = torch.arange(Tq, device=query.device)[:, None] + offset  # (Tq, 1): each query's key position
        if torch.equal(allowed, (j <= i) & in_run):
            break
    else:
        raise ValueError(
            "flashtile has no attn_mask: it runs a padded batch one sequence at a time when every sequence's "
            "real tokens are one contiguous run under a causal mask (left or right padding). This mask is "
            "something else (a sliding window, packed sequences, a block or custom mask, or right padding "
            "during generation: pad on the left to generate); use attn_implementation='sdpa' for it"
        )
    runs = [(b, b + 1, s, e) for b, (s, e) in enumerate(zip(start.tolist(), end.tolist()))]
    if len({run[2:] for run in runs}) == 1:  # the same run everywhere (a cache, no padding): one call, not B
        runs = [(0, B, *runs[0][2:])]
    rows = []
    for b0, b1, s, e in runs:
        q0, q1 = max(s - offset, 0), max(e - offset, 0)  # the real queries: key positions s ... e - 1
        o = query.new_zeros(b1 - b0, H, Tq, D)
        if q1 > q0:  # the new tokens are the last rows: the causal diagonal sits at the lower right
            o = attention(query[b0:b1, :, q0:q1], key[b0:b1, :, s:e], value[b0:b1, :, s:e],
                          is_causal=True, scale=scale, enable_gqa=gqa, alignment="lower_right")  # fmt: skip
            o = F.pad(o, (0, 0, q0, Tq - q1))  # zeros for the padding rows
        rows.append(o)
    return torch.cat(rows)  # (B, H, Tq, D)
# --8<-- [end:per_sequence]
