"""A measured probe, not part of the package: where one forward program's time goes, read from the SM's clock.

A copy of ``src/flashtile/kernels/forward.py`` is made with five clock reads added and nothing else changed
in the arithmetic (its outputs are checked bitwise against the package's): ``%clock64`` and ``%globaltimer``
when a program starts, ``%clock64`` once its key loop is done (the read takes the row sums ``l`` as an
input, so it waits for the last tile's softmax), ``%clock64`` and ``%globaltimer`` at its end (after its
stores are issued and its check for huge scores is decided; before abeadd2 this read came before the
check), and ``%smid``. One thread per program writes them to a buffer. From them, per program:

* ``start_to_loop_end``: the Q load, the pipeline's fill and every key tile;
* ``epilogue``: the last P V product, o = acc / l, the stores of o and of the row statistics, the check
  for huge scores;
* ``gap_on_sm``: from one program's end to the next program's first instruction on the same SM,
  what the GPU takes to retire a program and start the next (one program an SM at D = 128, T >= 1k).

The clock rate is measured too (cycles over globaltimer nanoseconds, per program), since the H200 runs its
SMs slower the longer a kernel keeps it busy.

    PYTHONPATH=src python bench/probes/forward_timeline.py OUT.json [name=path.py ...]

Each ``name=path.py`` is another version of the module (as ``forward_ab.py`` takes them), instrumented the
same way and read at the same shapes: its epilogue or its loop can then be compared with the package's
to a few hundredths of a microsecond, where timing whole kernels side by side resolves about 1.5%.
"""
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from flashtile.bench.common import median_ms, save_result
from flashtile.bench.providers import make_inputs
from flashtile.kernels import forward as package

sys.path.insert(0, str(Path(__file__).parent))
from forward_ab import absolute_imports, load  # noqa: E402

CLOCK = 'tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)'
CLOCK_AFTER_L = ('tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [l], dtype=tl.int64, is_pure=False, '
                 'pack=1)')  # takes l as an input, so it waits for the last tile's softmax
TIMER = 'tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)'
EDITS = (  # (anchor, replacement): each anchor must occur exactly once in the package's source
    ("    Q, K, V, O, ROW_STATS,\n", "    Q, K, V, TIMES, O, ROW_STATS,\n"),
    ("    # --8<-- [start:program]\n", f"    t0c = {CLOCK}\n    t0g = {TIMER}\n    # --8<-- [start:program]\n"),
    ("    # --8<-- [end:loops]\n", f"    t2c = {CLOCK_AFTER_L}\n    # --8<-- [end:loops]\n"),
    ("    # --8<-- [end:exact_rerun]\n", f"""    t3c = {CLOCK}
    t3g = {TIMER}
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)
    slot = TIMES + (tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1)
                                                             * tl.program_id(2))).to(tl.int64) * 6
    first = i == q_start  # one thread writes the program's six numbers
    tl.store(slot + 0 + 0 * i, t0c + 0 * i, mask=first)
    tl.store(slot + 1 + 0 * i, t0g + 0 * i, mask=first)
    tl.store(slot + 2 + 0 * i, t2c, mask=first)
    tl.store(slot + 3 + 0 * i, t3c + 0 * i, mask=first)
    tl.store(slot + 4 + 0 * i, t3g + 0 * i, mask=first)
    tl.store(slot + 5 + 0 * i, sm.to(tl.int64) + 0 * i, mask=first)
    # --8<-- [end:exact_rerun]
"""),
    ("    plan.launch(*loads, ", "    plan.launch(*loads, clock_buffer(plan.launch.grid, q.device), "),
)
SHAPES = (  # (Tq, Tk, causal, B) at H = 16, D = 128: the 2k cell, its key-count neighbours, causal, and T = 512
    (2048, 128, False, 8), (2048, 2048, False, 8), (2048, 4096, False, 8), (2048, 2048, True, 8), (512, 512, False, 32),
)


CLOCK_BUFFER = """

TIMES = {}  # the clock buffer of the last grid launched


def clock_buffer(grid, device):
    if TIMES.get("shape") != grid:
        TIMES.update(shape=grid, buffer=torch.zeros((grid[0] * grid[1] * grid[2], 6), dtype=torch.int64, device=device))
    return TIMES["buffer"]
"""


def instrumented_module(name: str = "package", path: str | None = None):
    """A copy of the package's forward module (or of the version at ``path``) with the clock reads added."""
    source = absolute_imports(Path(path or package.__file__).read_text())
    for anchor, replacement in EDITS:
        assert source.count(anchor) == 1, f"{name}: the anchor {anchor!r} moved"
        source = source.replace(anchor, replacement)
    copy = Path(tempfile.mkdtemp()) / f"forward_timeline_{name}.py"
    copy.write_text(source + CLOCK_BUFFER)
    return load(f"timeline_{name}", str(copy))


def quantiles(values) -> list[float]:
    ordered = sorted(values)
    return [round(ordered[min(len(ordered) - 1, int(p * len(ordered)))], 2) for p in (0.1, 0.5, 0.9)]


def measure(module, name, Tq, Tk, causal, B) -> dict:
    shape = dict(B=B, H=16, H_kv=16, Tq=Tq, Tk=Tk, D=128, causal=causal, layout="bhtd", dtype="bf16")
    q, k, v = make_inputs(shape)
    reference, _ = package.flash_attention(q, k, v, causal=causal)
    assert torch.equal(module.flash_attention(q, k, v, causal=causal)[0], reference), f"{name}: o differs"
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        cudnn_ms = median_ms(lambda: scaled_dot_product_attention(q, k, v, is_causal=causal), warmup=25, rep=100)
    package_ms = median_ms(lambda: package.flash_attention(q, k, v, causal=causal), warmup=25, rep=100)
    instrumented_ms = median_ms(lambda: module.flash_attention(q, k, v, causal=causal), warmup=25, rep=100)
    module.flash_attention(q, k, v, causal=causal)  # the launch whose clocks are read
    torch.cuda.synchronize()
    table = module.TIMES["buffer"].cpu().tolist()
    cycles_per_ns = statistics.median((c3 - c0) / (g3 - g0) for c0, g0, _, c3, g3, _ in table if g3 - g0 > 5000)
    us = lambda cycles: cycles / cycles_per_ns / 1e3  # noqa: E731
    on_sm = {}
    for row in table:
        on_sm.setdefault(row[5], []).append(row)
    gaps = []
    for rows in on_sm.values():
        rows.sort(key=lambda row: row[0])
        gaps += [us(after[0] - before[3]) for before, after in zip(rows, rows[1:])]
    span_us = (max(row[4] for row in table) - min(row[1] for row in table)) / 1e3
    programs = [us(row[3] - row[0]) for row in table]
    return {"pass": "forward", "provider": "flashtile_timeline", "version": name, **shape,
            "ms": round(instrumented_ms, 4), "package_ms": round(package_ms, 4), "sdpa_cudnn_ms": round(cudnn_ms, 4),
            "clock_ghz": round(cycles_per_ns, 3), "programs": len(table), "sms": len(on_sm),
            "span_us": round(span_us, 1), "busy_fraction": round(sum(programs) / (len(on_sm) * span_us), 3),
            "program_us_p10_p50_p90": quantiles(programs),
            "start_to_loop_end_us_p10_p50_p90": quantiles(us(row[2] - row[0]) for row in table),
            "epilogue_us_p10_p50_p90": quantiles(us(row[3] - row[2]) for row in table),
            "gap_on_sm_us_p10_p50_p90": quantiles(gaps)}  # fmt: skip


def main(out: str, specs: list[str]) -> None:
    torch.cuda.set_device(0)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    modules = {"package": instrumented_module()}
    for spec in specs:
        name, path = spec.split("=", 1)
        modules[name] = instrumented_module(name, path)
    rows = []
    for (Tq, Tk, causal, B), (name, module) in ((shape, version) for shape in SHAPES for version in modules.items()):
        rows.append(measure(module, name, Tq, Tk, causal, B))
        keys = ("version", "Tq", "Tk", "causal", "ms", "package_ms", "sdpa_cudnn_ms", "program_us_p10_p50_p90",
                "start_to_loop_end_us_p10_p50_p90", "epilogue_us_p10_p50_p90", "gap_on_sm_us_p10_p50_p90")
        print({key: rows[-1][key] for key in keys}, flush=True)
    save_result(out, rows, "one launch's per-program clocks (%clock64, %globaltimer, %smid) from a copy of the "
                "package's forward with the reads added, outputs bitwise equal to the package's; times: do_bench "
                "median (warmup 25 ms, rep 100 ms); quantiles 10/50/90% over the programs")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
