"""A compiled probe, not part of the package (no GPU needed): the package's backward kernels beside the ladder's
rung 4 at the same settings, compiled for sm_90.

``backward_d64_rung_settings.py`` timed the package's dK/dV kernel 20 % slower than rung 4's at D = 64, 512
tokens, causal, with rung 4's own tiles (64 x 64, 4 warps, 3 stages) passed through ``config=``. This probe
compiles both kernels (bf16, causal, pointers and TMA, contiguous-launch hints) at D = 64 and 128 with the same
tiles and reports what ptxas says (registers, spill stores, shared memory) and what the PTX holds: its exp2
(``ex2.approx``), its fused multiply-adds and its tensor-core instructions (``wgmma``), counted over the whole
kernel.

    PYTHONPATH=src:. python bench/probes/backward_d64_registers.py > backward-d64-registers.json
"""

from __future__ import annotations

import json
import textwrap

from tests._sm90 import compile_in_fresh_process

BODY = textwrap.dedent(
    """
    import re, subprocess, tempfile, inspect
    import torch
    from flashtile.kernels import backward
    from flashtile.kernels.ladder import rungs

    def ptxas(kernel):
        with tempfile.TemporaryDirectory() as tmp:
            with open(f"{tmp}/k.ptx", "w") as f:
                f.write(kernel.asm["ptx"])
            log = subprocess.run([triton.knobs.nvidia.ptxas.path, "-v", "--gpu-name=sm_90a", f"{tmp}/k.ptx", "-o",
                                  f"{tmp}/k.o"], capture_output=True, text=True, check=True).stderr
        ptx = kernel.asm["ptx"]
        return dict(registers=int(re.search(r"Used (\\d+) registers", log).group(1)),
                    spill_store_bytes=int(re.search(r"(\\d+) bytes spill stores", log).group(1)),
                    shared=kernel.metadata.shared, ex2=ptx.count("ex2.approx"), fma=len(re.findall(r"\\bfma\\.", ptx)),
                    wgmma=ptx.count("wgmma.mma_async"), ld_global=ptx.count("ld.global"),
                    ptx_lines=ptx.count("\\n"))

    rung = rungs("backward")[-1].load()
    out = []
    for D in (64, 128):
        for tma in (False, True):
            for name in ("dkdv", "dq"):
                bq, bk, warps, stages = rung.settings(D, torch.bfloat16)[name]
                types = {n: "*bf16" for n in ("Q", "K", "V", "O", "DO", "DK", "DV", "DQ")}
                types.update(LSE="*fp32", DELTA="*fp32", ROWS="*fp32", STATS="*fp32", DQ_ACC="*fp32", unit="fp32",
                             scale="fp32", qk_scale="fp32", softcap="fp32")
                if tma:
                    streamed, rows = (("Q", "DO"), bq) if name == "dkdv" else (("K", "V"), bk)
                    types.update({n: f"tensordesc<bf16[1, 1, {rows}, {D}]>" for n in streamed})
                every = dict(HEAD_DIM=D, HEAD_DIM_PAD=D, BLOCK_Q=bq, BLOCK_K=bk, CAUSAL=True, USE_TMA=tma,
                             HEAVIEST_FIRST=True, DOT_PRECISION="tf32", SIGN=1, WIDE=False, BAND=False,
                             SOFTCAP=False, ATOMIC_DQ=False, INTERPRETED=False, SPLIT=1)
                for who, fn in (("rung_4", getattr(rung, name + "_kernel")),
                                ("package", getattr(backward, f"backward_{name}_kernel"))):
                    params = inspect.signature(fn.fn).parameters
                    constexprs = {n: x for n, x in every.items() if n in params}
                    kernel = sm90_like_a_launch(fn, types, constexprs, num_warps=warps, num_stages=stages)
                    out.append(dict(kernel=name, who=who, D=D, tma=tma, settings=[bq, bk, warps, stages],
                                    **ptxas(kernel)))
    print(json.dumps({"kernels": out}))
    """
)


def main() -> None:
    import datetime
    import subprocess

    import triton

    result = compile_in_fresh_process(BODY)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    provenance = dict(compiled_for="sm_90a (ptxas -v, no GPU)", triton=triton.__version__, commit=commit,
                      date_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                      method="bf16, causal, contiguous-launch hints; each kernel at rung 4's settings for its D; "
                             "registers and spill stores from ptxas -v; ex2, fma, wgmma, ld.global: PTX counts")
    print(json.dumps(dict(provenance=provenance, rows=result["kernels"]), indent=1))


if __name__ == "__main__":
    main()
