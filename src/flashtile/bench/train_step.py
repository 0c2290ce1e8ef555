"""Train-step table: a Hugging Face Llama built from a config, one forward + backward, flashtile vs SDPA.

Both providers are the same model (same weights, random, no downloads) with a different
``attn_implementation``: ``flashtile`` (``flashtile.integrations.transformers.register()``) and
``sdpa`` (transformers' SDPA path, which lets torch pick its backend: cuDNN or flash on an H100/H200).
A step is ``zero_grad(set_to_none=True)``, ``model(ids, labels=ids).loss.backward()``; no optimizer, so
the difference between rows is attention. Measured in the same process, the same run.

Accuracy (``--check``, main shape only): logits and parameter gradients of each bf16 provider against
the same weights in float32 with transformers' eager attention (matmul + softmax, independent of both).
``logits_max_abs_err`` is max |logits - truth|; ``grad_rel_err`` is ||g - g_truth|| / ||g_truth|| over
all parameters at once.

Rows follow bench/BENCH_SCHEMA (``pass: "train_step"``), with extra fields for the model: ``layers``,
``hidden``, ``intermediate``, ``vocab``. ``tflops`` counts the model's matmuls: 6 * N * tokens (N: the
parameters of every linear layer, lm_head included) plus 3.5 * 4 * B * H * T^2 * D * 0.5 per layer for
causal attention (forward 1x, backward 2.5x, the convention of the other tables), over the step time.

Needs a CUDA device and transformers; the committed table is ``bench/results/train_step.json``.
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
PROVIDERS = ("flashtile", "sdpa")
WARMUP_MS, REP_MS = 200, 2000
METHOD = (
    "one training step (zero_grad, forward with labels, loss.backward; no optimizer) of a transformers "
    "LlamaForCausalLM built from a config, bf16, random weights and tokens; triton.testing.do_bench median "
    f"(warmup {WARMUP_MS} ms, rep {REP_MS} ms); TFLOP/s = (6 * linear params * tokens + "
    "3.5 * layers * 2 * B * H * T^2 * D) / time"
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


def step_flops(shape: dict, model) -> float:
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    tokens = shape["B"] * shape["T"]
    attention = 3.5 * shape["layers"] * 4 * shape["B"] * shape["H"] * shape["T"] ** 2 * shape["D"] * 0.5
    return 6 * linear * tokens + attention


def token_ids(shape: dict, device, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, shape["vocab"], (shape["B"], shape["T"]), generator=gen).to(device)


def forward_backward(model, ids):
    """One step; returns (logits float32, loss). Gradients are left in the parameters."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach().float(), out.loss.detach().float()


def accuracy(model, ids, truth_logits, truth_grads) -> dict:
    logits, _ = forward_backward(model, ids)
    grads = [p.grad.float() for p in model.parameters()]
    diff = torch.sqrt(sum(((g - t) ** 2).sum() for g, t in zip(grads, truth_grads)))
    norm = torch.sqrt(sum((t**2).sum() for t in truth_grads))
    model.zero_grad(set_to_none=True)
    return dict(logits_max_abs_err=float(f"{(logits - truth_logits).abs().max().item():.3g}"),
                grad_rel_err=float(f"{(diff / norm).item():.3g}"))  # fmt: skip


def measure(shape: dict, check: bool = False, device="cuda", dtype=torch.bfloat16, timer=None) -> list[dict]:
    """One row per provider for ``shape``; ``check`` adds the accuracy fields (needs a float32 eager copy)."""
    from ..integrations.transformers import register

    timer = timer or (lambda fn: _median_ms(fn))
    names = {"flashtile": register(), "sdpa": "sdpa"}
    ids = token_ids(shape, device)
    truth = None
    if check:
        eager = build(shape, "eager", device, torch.float32)
        truth = forward_backward(eager, ids)[0], [p.grad.float() for p in eager.parameters()]
        del eager
    rows = []
    for provider in PROVIDERS:
        row = {"pass": "train_step"}
        row.update(provider=provider, B=shape["B"], H=shape["H"], H_kv=shape["H_kv"],
                   Tq=shape["T"], Tk=shape["T"], D=shape["D"], causal=True, layout="bthd",
                   dtype={torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype],
                   layers=shape["layers"], hidden=shape["hidden"], intermediate=shape["intermediate"],
                   vocab=shape["vocab"])  # fmt: skip
        try:
            model = build(shape, names[provider], device, dtype)
            if truth is not None:
                row.update(accuracy(model, ids, *truth))
            ms = timer(lambda model=model: forward_backward(model, ids))
            row.update(ms=round(ms, 3), tflops=round(step_flops(shape, model) / (ms * 1e-3) / 1e12, 1))
        except torch.OutOfMemoryError:
            row.update(ms=None, tflops=None, error="OOM")
        finally:
            model = None
            if device == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        print(f"{provider:>10} {shape} {row.get('ms')} ms {row.get('tflops')} TFLOP/s "
              f"{ {k: row[k] for k in ('logits_max_abs_err', 'grad_rel_err') if k in row} }", flush=True)  # fmt: skip
    by = {row["provider"]: row for row in rows}
    if by["flashtile"]["ms"] and by["sdpa"]["ms"]:
        print(f"sdpa_ms / flashtile_ms = {by['sdpa']['ms'] / by['flashtile']['ms']:.3f} (target >= 0.9)", flush=True)
    return rows


def _median_ms(fn) -> float:
    from .common import median_ms

    return median_ms(fn, warmup=WARMUP_MS, rep=REP_MS)


def run(out, check: bool = True, extra: bool = True) -> dict:
    rows = measure(MAIN_SHAPE, check=check)
    for shape in EXTRA_SHAPES if extra else []:
        rows += measure(shape)
    return save_result(out, rows, METHOD, main_shape=MAIN_SHAPE)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flashtile.bench.train_step", description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="default: bench/results/train_step.json")
    parser.add_argument("--no-check", action="store_true", help="skip the float32 eager accuracy check")
    parser.add_argument("--main-only", action="store_true", help="only the 8-layer model at B=2, T=2048")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the benchmarks need a CUDA device")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from configs; nothing is downloaded
    run(args.out or RESULTS / "train_step.json", check=not args.no_check, extra=not args.main_only)


if __name__ == "__main__":
    main()
