"""Shared helpers for the kernel tests: where to run, and how close is close enough.

On a machine without CUDA the root conftest turns the Triton interpreter on and tensors live on
the CPU; with CUDA the same tests run the compiled kernels on the GPU.
"""

from __future__ import annotations

import json
import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"

# Forward tolerances against the float64 truth on the same (rounded) inputs.
# fp32: full fp32 dots ("ieee") in the interpreter and on the GPU. fp16: P is rounded to fp16 before the
# P @ V dot and O is stored in fp16, each a relative error of at most 2**-11.
FORWARD_TOL = {
    torch.float32: dict(atol=5e-5, rtol=5e-5) if ON_GPU else dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
LSE_TOL = {  # lse is accumulated and stored in fp32 whatever the input dtype
    torch.float32: dict(atol=5e-5, rtol=5e-5) if ON_GPU else dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=1e-4, rtol=1e-4),
}


def randn(*shape, dtype=torch.float32, generator=None, device=DEVICE):
    """Fresh normal samples made on the CPU (reproducible under a seeded generator), then moved."""
    return torch.randn(*shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)


def assert_attention_close(o, lse, o_ref, lse_ref, dtype):
    """o and lse match a float64 reference; rows that see no key match exactly (o = 0, lse = -inf)."""
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse).cpu(), torch.isneginf(lse_ref).cpu())
    torch.testing.assert_close(o.double().cpu(), o_ref.double().cpu(), **FORWARD_TOL[dtype])
    finite = torch.isfinite(lse_ref).cpu()
    torch.testing.assert_close(lse.double().cpu()[finite], lse_ref.double().cpu()[finite], **LSE_TOL[dtype])


def case_id(case) -> str:
    """A readable pytest id for a (B, H, H_kv, Tq, Tk, D, causal, alignment, dtype) case."""
    B, H, H_kv, Tq, Tk, D, causal, alignment, dtype = case
    mask = alignment if causal else "full"
    return f"B{B}-H{H}/{H_kv}-Tq{Tq}-Tk{Tk}-D{D}-{mask}-{str(dtype)[6:]}"


def once_per_run(tmp_path_factory, name: str, make):
    """``make()`` (JSON-able) computed once per test run, even when pytest-xdist runs the tests that need it
    on several workers: the first worker to take the lock computes and writes it into the folder the
    run's workers share (the parent of each worker's base temp folder), the others read it."""
    from filelock import FileLock  # a dependency of torch

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    path = root / f"{name}.json"
    with FileLock(str(path) + ".lock"):
        if path.is_file():
            return json.loads(path.read_text())
        value = make()
        path.write_text(json.dumps(value))
        return value
