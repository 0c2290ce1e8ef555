"""Train-step table: a Hugging Face Llama built from a config, one forward + backward, flashtile vs SDPA.

Both providers are the same model (same weights, random, no downloads) with a different
``attn_implementation``: ``flashtile`` (``flashtile.integrations.transformers.register()``) and
``sdpa`` (transformers' SDPA path, which lets torch pick its backend: cuDNN or flash on an H100/H200).
A step is ``zero_grad(set_to_none=True)``, ``model(ids, labels=ids).loss.backward()``; no optimizer, so
the difference between rows is attention. Measured in the same process, the same run, the providers taking
turns over ``ROUNDS`` rounds (a row's ``ms`` is the median of its ``ms_rounds``): a step of the small model
is mostly host time, and the host's speed drifts within a process.

Accuracy (``--check``, main shape only): logits and parameter gradients of each bf16 provider against
the same weights in float32 with transformers' eager attention (matmul + softmax, independent of both).
``logits_max_abs_err`` is max |logits - truth|; ``grad_rel_err`` is ||g - g_truth|| / ||g_truth|| over
all parameters at once.

Rows follow bench/BENCH_SCHEMA (``pass: "train_step"``), with extra fields for the model: ``layers``,
``hidden``, ``intermediate``, ``vocab``. ``tflops`` counts the model's matmuls: 6 * N * tokens (N: the
parameters of every linear layer, lm_head included) plus 3.5 * 4 * B * H * T^2 * D * 0.5 per layer for
causal attention (forward 1x, backward 2.5x, the convention of the other tables), over the step time.

The padded case (``--padded``, issue 36): the main model on B = 8 sequences whose lengths are drawn
uniformly from 512 to 2048 (a fixed seed), right-padded to 2048, the same ``attention_mask`` for both
providers (SDPA gets transformers' boolean mask; flashtile runs each layer as one ``attention_varlen``
call on the real tokens), labels -100 on the padding. Its rows carry ``lengths``, and ``tflops`` counts
useful work: the linear layers on the real tokens and attention on the pairs the mask keeps,
6 * N * sum(L) + 3.5 * layers * 4 * H * D * sum(L^2) / 2. Accuracy there is over the real tokens' logits.

Needs a CUDA device and transformers; the committed tables are ``bench/results/train_step.json`` and
``bench/results/train_step_padded.json``.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch

from .common import RESULTS, save_result

# The model of the project's first integration report: 8 layers, hidden 1024, 16 heads, 4 KV heads.
MAIN_SHAPE = dict(layers=8, hidden=1024, H=16, H_kv=4, D=64, intermediate=2816, vocab=32000, B=2, T=2048)
EXTRA_SHAPES = [  # a Llama-3-8B-shaped stack, a few layers of it
    dict(layers=2, hidden=4096, H=32, H_kv=8, D=128, intermediate=14336, vocab=32000, B=1, T=4096),
    dict(layers=2, hidden=4096, H=32, H_kv=8, D=128, intermediate=14336, vocab=32000, B=1, T=8192),
]
# The padded batch of issue 36: the main model, 8 sequences of 512 to 2048 tokens padded to 2048
PADDED_SHAPE = dict(MAIN_SHAPE, B=8, T=2048, min_length=512)
PROVIDERS = ("flashtile", "sdpa")
ROUNDS = 3  # each provider timed this many times, taking turns (``measure``)
WARMUP_MS, REP_MS = 200, 2000
METHOD = (
    "one training step (zero_grad, forward with labels, loss.backward; no optimizer) of a transformers "
    "LlamaForCausalLM built from a config, bf16, random weights and tokens; triton.testing.do_bench median "
    f"(warmup {WARMUP_MS} ms, rep {REP_MS} ms); TFLOP/s = (6 * linear params * tokens + "
    "3.5 * layers * 2 * B * H * T^2 * D) / time; the providers take turns over 3 rounds (alternating order) and "
    "ms is the median of a provider's rounds (ms_rounds)"
)


def llama_config(shape: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["H"], num_key_value_heads=shape["H_kv"],
        head_dim=shape["D"], max_position_embeddings=max(shape["T"], 2048), attention_dropout=0.0,
    )  # fmt: skip


def build(shape: dict, attn_implementation: str, device, dtype, seed: int = 0):
    """The model of ``shape`` on ``attn_implementation``; the same ``seed`` gives the same weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = copy.deepcopy(llama_config(shape))  # from_config writes the implementation into its config
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.to(device=device, dtype=dtype).train()


def step_flops(shape: dict, model, lengths: list[int] | None = None) -> float:
    """The step's FLOPs; with ``lengths`` (a padded batch), the useful ones: real tokens, kept pairs."""
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    lengths = lengths or [shape["T"]] * shape["B"]
    pairs = sum(n * n for n in lengths) * 0.5  # causal: half of each sequence's square
    return 6 * linear * sum(lengths) + 3.5 * shape["layers"] * 4 * shape["H"] * shape["D"] * pairs


def token_ids(shape: dict, device, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, shape["vocab"], (shape["B"], shape["T"]), generator=gen).to(device)


def padding_mask(shape: dict, device, seed: int = 2) -> tuple[torch.Tensor, list[int]]:
    """(attention_mask (B, T) int64, 1 on the real tokens, right padding; the lengths), lengths uniform in
    [min_length, T] from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shape["min_length"], shape["T"] + 1, (shape["B"],), generator=gen)
    mask = (torch.arange(shape["T"])[None, :] < lengths[:, None]).long()
    return mask.to(device), lengths.tolist()


def forward_backward(model, ids, mask=None):
    """One step; returns (logits float32, loss). Gradients are left in the parameters. With ``mask``
    (right padding), the padding is no label."""
    model.zero_grad(set_to_none=True)
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.logits.detach().float(), out.loss.detach().float()


def accuracy(model, ids, truth_logits, truth_grads, mask=None) -> dict:
    """Errors against the truth; with ``mask``, over the real tokens' logits (padding rows are zeros in
    flashtile and an average of values in SDPA and eager: no real token reads them)."""
    logits, _ = forward_backward(model, ids, mask)
    grads = [p.grad.float() for p in model.parameters()]
    diff = torch.sqrt(sum(((g - t) ** 2).sum() for g, t in zip(grads, truth_grads)))
    norm = torch.sqrt(sum((t**2).sum() for t in truth_grads))
    model.zero_grad(set_to_none=True)
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    return dict(logits_max_abs_err=float(f"{(logits - truth_logits)[real].abs().max().item():.3g}"),
                grad_rel_err=float(f"{(diff / norm).item():.3g}"))  # fmt: skip


def measure(shape: dict, check: bool = False, device="cuda", dtype=torch.bfloat16, timer=None) -> list[dict]:
    """One row per provider for ``shape``; ``check`` adds the accuracy fields (needs a float32 eager copy).
    A shape with ``min_length`` is a right-padded batch (``padding_mask``), the same mask for every provider."""
    from ..integrations.transformers import register

    timer = timer or (lambda fn: step_median_ms(fn))
    names = {"flashtile": register(), "sdpa": "sdpa"}
    ids = token_ids(shape, device)
    mask, lengths = padding_mask(shape, device) if "min_length" in shape else (None, None)
    truth = None
    if check:
        eager = build(shape, "eager", device, torch.float32)
        truth = forward_backward(eager, ids, mask)[0], [p.grad.float() for p in eager.parameters()]
        del eager
    rows, models = [], {}
    for provider in PROVIDERS:
        row = {"pass": "train_step"}
        row.update(provider=provider, B=shape["B"], H=shape["H"], H_kv=shape["H_kv"],
                   Tq=shape["T"], Tk=shape["T"], D=shape["D"], causal=True, layout="bthd",
                   dtype={torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype],
                   layers=shape["layers"], hidden=shape["hidden"], intermediate=shape["intermediate"],
                   vocab=shape["vocab"], mask="causal")  # fmt: skip
        if lengths is not None:
            row.update(lengths=lengths, padding="right")
        try:
            models[provider] = build(shape, names[provider], device, dtype)
            if truth is not None:
                row.update(accuracy(models[provider], ids, *truth, mask=mask))
        except torch.OutOfMemoryError:
            models.pop(provider, None)
            row.update(ms=None, tflops=None, error="OOM")
        rows.append(row)
    # The providers take turns, ROUNDS times, each round in the other order: a step of these models is mostly
    # host time, and the host's speed drifts within a process, so timing one provider after the other would
    # give the first and the second different hosts. Each row's ms is the median of its rounds.
    times = {provider: [] for provider in models}
    for round_ in range(ROUNDS):
        for provider in (PROVIDERS if round_ % 2 == 0 else PROVIDERS[::-1]):
            if provider in models:
                model = models[provider]
                times[provider].append(timer(lambda model=model: forward_backward(model, ids, mask)))
    for row in rows:
        if row["provider"] in models:
            ms = sorted(times[row["provider"]])[len(times[row["provider"]]) // 2]
            row.update(ms=round(ms, 3), ms_rounds=[round(t, 3) for t in times[row["provider"]]],
                       tflops=round(step_flops(shape, models[row["provider"]], lengths) / (ms * 1e-3) / 1e12, 1))
        print(f"{row['provider']:>10} {shape} {row.get('ms')} ms {row.get('tflops')} TFLOP/s "
              f"{ {k: row[k] for k in ('logits_max_abs_err', 'grad_rel_err', 'ms_rounds') if k in row} }",
              flush=True)  # fmt: skip
    models.clear()
    if device == "cuda":
        torch.cuda.empty_cache()
    by = {row["provider"]: row for row in rows}
    if by["flashtile"]["ms"] and by["sdpa"]["ms"]:
        ratio, target = by["sdpa"]["ms"] / by["flashtile"]["ms"], "1.0" if lengths else "0.9"
        print(f"sdpa_ms / flashtile_ms = {ratio:.3f} (target >= {target})", flush=True)
    return rows


def step_median_ms(fn) -> float:
    from .common import median_ms

    return median_ms(fn, warmup=WARMUP_MS, rep=REP_MS)


def run(out, check: bool = True, extra: bool = True) -> dict:
    rows = measure(MAIN_SHAPE, check=check)
    for shape in EXTRA_SHAPES if extra else []:
        rows += measure(shape)
    return save_result(out, rows, METHOD, main_shape=MAIN_SHAPE)


def run_padded(out, check: bool = True) -> dict:
    """The padded case alone, into its own file (the main table's rows are keyed by model and T)."""
    method = METHOD.replace("random weights and tokens", "random weights and tokens, B = 8 right-padded "
                            "sequences of 512 to 2048 tokens, the same attention_mask for both") + (
        "; for the padded rows, the useful FLOPs: 6 * linear params * sum(L) + 3.5 * layers * 2 * H * D * sum(L^2)")
    return save_result(out, measure(PADDED_SHAPE, check=check), method, main_shape=PADDED_SHAPE)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flashtile.bench.train_step", description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="default: bench/results/train_step.json")
    parser.add_argument("--no-check", action="store_true", help="skip the float32 eager accuracy check")
    parser.add_argument("--main-only", action="store_true", help="only the 8-layer model at B=2, T=2048")
    parser.add_argument("--padded", action="store_true",
                        help="only the padded case: B=8, lengths 512-2048 (default out: train_step_padded.json)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the benchmarks need a CUDA device")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from configs; nothing is downloaded
    if args.padded:
        run_padded(args.out or RESULTS / "train_step_padded.json", check=not args.no_check)
    else:
        run(args.out or RESULTS / "train_step.json", check=not args.no_check, extra=not args.main_only)


if __name__ == "__main__":
    main()
