"""Loss curves of one small causal language model trained from the same start with different attention
implementations: the "In a real model" chapter's training claim, and the figure the site draws from it.

Needs transformers (the ``test`` extra). Runs on the CPU in a few seconds.
"""

from __future__ import annotations

import copy

import torch

# --8<-- [start:tiny_llama]
# A two-layer Llama small enough for a CPU, with grouped-query attention (4 query heads,
# 2 key/value heads) and large initial weights, so that attention is far from uniform
# and mistakes show.
TINY_LLAMA = dict(
    vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3,
)  # fmt: skip
# --8<-- [end:tiny_llama]


# --8<-- [start:curves]
def training_curves(
    config, implementations, steps: int = 12, lr: float = 1e-2
) -> dict[str, list[float]]:
    """The loss at each of ``steps`` AdamW steps, per attention implementation, from the
    same weights on the same batches: only the attention implementation differs between
    the curves.

    Each batch is 4 sequences of 16 tokens whose second half repeats the first, so the
    loss can only fall by attending back to the first half.
    """
    from transformers import AutoModelForCausalLM

    curves = {}
    for implementation in implementations:
        torch.manual_seed(0)  # the same weights for every implementation
        model = AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation=implementation
        )
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        # the same batches for every implementation
        batches = torch.Generator().manual_seed(2)
        curves[implementation] = []
        for _ in range(steps):
            batch = torch.randint(1, config.vocab_size, (4, 16), generator=batches)
            # the second half repeats the first: learnable by attention
            batch[:, 8:] = batch[:, :8]
            loss = model(batch, labels=batch).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            curves[implementation].append(loss.item())
    return curves
# --8<-- [end:curves]


def training_curves_svg(curves: dict[str, list[float]], labels: dict[str, str]) -> str:
    """The curves as an SVG line plot (matplotlib, rendered in memory), one line per implementation."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 3.2), dpi=100)
    styles = [dict(color="#d62728", marker="o", linewidth=2.5), dict(color="#1f77b4", marker="x", linestyle="--")]
    for (implementation, losses), style in zip(curves.items(), styles):
        ax.plot(range(1, len(losses) + 1), losses, label=labels.get(implementation, implementation), **style)
    ax.set_xlabel("AdamW step")
    ax.set_ylabel("training loss")
    ax.set_title("tiny Llama (2 layers, 4 / 2 heads), CPU")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", frameon=False)
    fig.tight_layout()
    out = io.StringIO()
    fig.savefig(out, format="svg", metadata={"Date": None})  # no timestamp: the same curves, the same file
    plt.close(fig)
    return out.getvalue()
