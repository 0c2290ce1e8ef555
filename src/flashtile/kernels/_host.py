"""What the kernels need on the host: launcher checks, device probes, scheduling heuristics, the
softmax scale's split into kernel units, TMA descriptors and the launch cache, each written once.

The launcher checks add what only a kernel needs on top of ``flashtile._checks`` (which stays the
one place for shape, dtype and argument validation, the same for every tier): a device Triton can
run on, tile sizes ``tl.arange`` and ``tl.dot`` accept, and launch settings. What runs inside the
kernels (``@triton.jit`` helpers) lives in ``flashtile.kernels._jit``.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton

from .._checks import UNBOUNDED, check_block, check_int
from .._env import is_interpreting, sm_count
from .._plans import recall_fact, remember_fact
from .._spec import MaskBand
from ..hopper import H200

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_DOT_BLOCK = 16  # tl.dot needs every dimension of its operands to be at least 16
MAX_GRID_YZ = 65535  # CUDA's limit on the second and third grid dimensions (heads, batch)
LOG2E = math.log2(math.e)
FLOAT32_TINY = torch.finfo(torch.float32).tiny


def check_kernel_device(name: str, x: torch.Tensor) -> None:
    """A compiled Triton kernel needs a CUDA tensor; the interpreter also takes CPU tensors, but not
    bf16 ones, whose arithmetic it gets wrong (Triton issue 11584) without any warning."""
    if x.device.type != "cuda" and not is_interpreting():
        raise ValueError(
            f"{name} is on {x.device}, but Triton kernels need a CUDA device "
            "(or set TRITON_INTERPRET=1 before importing flashtile to run them on the CPU)"
        )
    if x.device.type == "cpu" and x.dtype == torch.bfloat16:
        raise TypeError(
            f"{name} is a bfloat16 CPU tensor: the Triton interpreter computes bfloat16 wrongly (Triton issue "
            "11584); use float16 or float32 on the CPU, a CUDA device, or flashtile.attention, which runs "
            "bfloat16 CPU tensors on the reference tier"
        )


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision, the same in the forward and the backward: fp32 inputs are multiplied
    in full fp32 ("ieee"), never silently in tf32, so that the backward recomputes bit for bit the raw
    dots the forward's (m, l) were taken from; 16-bit inputs ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def head_dim_pad(head_dim: int) -> int:
    """The head dim rounded up to a power of two (tl.arange needs one) and to 16 (tl.dot needs it)."""
    return max(MIN_DOT_BLOCK, 1 << (head_dim - 1).bit_length())  # plain Python: this runs on every call


def check_tile_size(name: str, value, minimum: int = MIN_DOT_BLOCK) -> int:
    """A constexpr tile size: a positive int, a power of two (tl.arange needs one) and at least ``minimum``."""
    value = check_block(name, value)
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")
    return value


def check_launch(num_warps, num_stages) -> tuple[int, int]:
    """Launch settings for benchmarks: warps a power of two from 1 to 32, stages at least 1."""
    num_warps = check_int("num_warps", num_warps)
    if num_warps > 32 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps must be a power of two from 1 to 32, got {num_warps}")
    return num_warps, check_int("num_stages", num_stages)


def launch_settings(config: dict, block_q=None, block_k=None, num_warps=None, num_stages=None):
    """(block_q, block_k, num_warps, num_stages, own): a caller's overrides checked, the rest from ``config``
    (a ``forward_config``-shaped dict), and whether the result is exactly the config's own settings (options
    such as a register cap were measured with those settings only)."""
    block_q = config["block_q"] if block_q is None else check_tile_size("block_q", block_q)
    block_k = config["block_k"] if block_k is None else check_tile_size("block_k", block_k)
    num_warps, num_stages = check_launch(
        config["num_warps"] if num_warps is None else num_warps,
        config["num_stages"] if num_stages is None else num_stages,
    )
    own = (block_q, block_k, num_warps, num_stages) == (
        config["block_q"], config["block_k"], config["num_warps"], config["num_stages"])
    return block_q, block_k, num_warps, num_stages, own


def head_batch_grid(n_tiles: int, heads: int, batch: int) -> tuple[int, int, int]:
    """Grid (tiles, heads, batch): the tiles on the first axis (2**31 - 1 programs), heads and batch on
    the other two, each at most 65,535. The tiles of one head are launched together, as before."""
    for name, n in (("number of heads", heads), ("batch size", batch)):
        if n > MAX_GRID_YZ:
            raise ValueError(f"the {name} must be at most {MAX_GRID_YZ} (a CUDA grid dimension), got {n}")
    return (n_tiles, heads, batch)



# --8<-- [start:launch_order]
HEAVIEST_FIRST_BYTES = 16 * 2**20  # what one chunk's heads stream at most, so that it stays in the 50 MB L2
HEAVIEST_FIRST_WAVES = 8  # past this many waves of programs the tail is too short a part to pay for the order
REGISTERS_PER_SM = H200.registers_per_sm  # 32-bit registers of one SM (sm_80 and sm_90 alike)


def resident_programs(num_warps: int, maxnreg: int | None) -> int:
    """How many programs of a launch one SM holds at once, as the registers allow: each thread takes at
    most ``maxnreg`` registers, or 255 without a cap (a bound: an uncapped kernel may need fewer)."""
    return max(1, REGISTERS_PER_SM // (num_warps * 32 * (maxnreg or 255)))


def heaviest_first_chunk(causal: bool, plane_bytes: int, pairs: int, programs: int, resident: int,
                         device: torch.device, share: int = 1) -> int:  # fmt: skip
    """(plane, batch) pairs per chunk of a heaviest-first launch (``program_tile``), or 0: the plain order.

    ``plane_bytes``: what the programs of one plane stream from HBM (their K and V, or Q and dO), as a
    share of what ``share`` neighbouring planes read together (a GQA group's query heads read one kv
    head); chunks hold a multiple of ``share`` planes, as many as fit in HEAVIEST_FIRST_BYTES, at most
    all ``pairs``. The plain order (0) without a causal mask, where every tile has the same work, and
    for grids longer than HEAVIEST_FIRST_WAVES waves (``programs`` over the SMs times ``resident``, the
    programs one SM holds): on the H200 the new order paid at a few waves and lost at sixteen
    (sweeps/launch-order.json).
    """
    if not causal:
        return 0
    if programs > HEAVIEST_FIRST_WAVES * resident * sm_count(device):
        return 0
    fit = HEAVIEST_FIRST_BYTES // max(plane_bytes, 1) // share * share
    return min(max(fit, share), pairs)
# --8<-- [end:launch_order]


# --8<-- [start:kernel_mask]
class KernelMask(NamedTuple):
    """Which mask body a kernel compiles, and its band: the causal one (CAUSAL), the
    window's (BAND), or none."""

    causal: bool  # j <= i + offset: the causal path, as without a window
    banded: bool  # lo <= j - i <= hi with both edges: the window path
    band: tuple[int, int]  # the kernel's two band arguments (below)
    # (lo, hi) of one sequence, clamped into [-Tq, Tk]; None for packed documents
    diagonals: tuple[int, int] | None


def kernel_mask(mask: MaskBand, Tq: int | None = None,
                Tk: int | None = None) -> KernelMask:  # fmt: skip
    """The kernels' mask for a checked band, run as no mask or as the causal mask where
    the band is one of those, so that such a call compiles and runs exactly as a call
    without a window does.

    With one sequence's sizes Tq and Tk, ``band`` is the window path's (lo, hi),
    lo <= j - i <= hi (``reference.masks.window_band``: an unbounded side becomes an
    edge no pair reaches), and (0, 0), unused, on the other paths; a band that keeps
    every pair, or exactly the causal ones, takes those paths. Without them (packed
    documents, each with its own Tq and Tk), ``band`` is the sides (left, right), which
    each document's programs turn into its own edges (``_jit.varlen_program``)."""
    left, right = mask.left, mask.right
    if Tq is None:
        causal = left == UNBOUNDED and right == 0
        everything = left == right == UNBOUNDED
        return KernelMask(causal, not (causal or everything), (left, right), None)
    offset = mask.offset(Tq, Tk)
    # j - i >= -(Tq - 1) and j - i <= Tk - 1 always hold
    lo = -Tq if left == UNBOUNDED else max(offset - left, -Tq)
    hi = Tk if right == UNBOUNDED else min(offset + right, Tk)
    if lo == -Tq and hi == Tk:  # every pair: no mask
        return KernelMask(False, False, (0, 0), (lo, hi))
    if lo == -Tq and hi == offset:  # j <= i + offset: causal
        return KernelMask(True, False, (0, 0), (lo, hi))
    return KernelMask(False, True, (lo, hi), (lo, hi))
# --8<-- [end:kernel_mask]


# --8<-- [start:kernel_scale]
class KernelScale(NamedTuple):
    """How the kernels carry the softmax scale τ so that every exponent is a difference
    of raw dots.

    S = τ · q·k is computed as ``unit`` · (sign · q)·k, with ``sign`` in {1, -1, 0}
    folded into the query tile and ``unit`` = |τ| > 0. The row max m is then a max of
    raw dots u = (sign · q)·k, one of the very numbers it is subtracted from, so u - m
    is exact for the largest score at any magnitude, and P = exp2((u - m) · qk_scale)
    with qk_scale = unit · log2(e) > 0.
    """

    sign: int
    unit: float
    qk_scale: float


def kernel_scale(scale: float) -> KernelScale:
    """Split τ into (sign, unit, qk_scale). τ = 0 becomes sign 0 (every score 0 · (q·k),
    NaN kept) and unit 1; so does a |τ| too small for float32, whose scores would round
    to 0 anyway."""
    unit = abs(scale)
    if unit * LOG2E < FLOAT32_TINY:
        return KernelScale(0, 1.0, LOG2E)
    return KernelScale(1 if scale > 0 else -1, unit, unit * LOG2E)
# --8<-- [end:kernel_scale]


# --8<-- [start:tma]
def tma_strides(x: torch.Tensor) -> list[int] | None:
    """Strides under which the tensor-memory accelerator (TMA) can fetch tiles of ``x``, or None.

    A TMA descriptor needs a 16-byte-aligned base, a contiguous last dim, and every other stride a
    positive multiple of 16 bytes. A dim of size 1 is never stepped along, so its stride is free: it
    is replaced by one that qualifies. Anything else (a transposed head dim, heads expanded with
    stride 0, a (B, T, H, D) view with an odd head dim, an empty dim) takes the pointer path.
    """
    if x.numel() == 0 or x.stride(-1) != 1 or x.data_ptr() % 16:
        return None
    align = 16 // x.element_size()  # elements per 16 bytes
    strides = list(x.stride())
    for i in reversed(range(x.dim() - 1)):
        if x.shape[i] == 1:  # never stepped along: any aligned stride will do
            strides[i] = -(-strides[i + 1] * x.shape[i + 1] // align) * align
        if strides[i] <= 0 or strides[i] % align:
            return None
    return strides


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _hopper_or_newer(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 (Hopper, the H200) or newer."""
    if device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


def has_tma(device: torch.device) -> bool:
    """Whether ``device`` has TMA: Hopper (sm_90) and newer GPUs, and Triton's interpreter, which
    emulates descriptors on the CPU."""
    return _hopper_or_newer(device) if device.type == "cuda" else is_interpreting()


def use_tma(tma, *tensors) -> list | None:
    """The strides of each tensor's TMA descriptor, or None where the pointer path runs.

    tma=True asks for TMA and raises when the device (compute capability 9.0 or newer; the interpreter
    emulates it) or a tensor's layout (``tma_strides``) cannot have it; "auto" takes it when possible;
    False never does. A launcher passes its config's choice unless the caller gives one.
    """
    if tma is False:
        return None
    strides = [tma_strides(x) for x in tensors]
    possible = all(s is not None for s in strides) and has_tma(tensors[0].device)
    if tma is True and not possible:
        raise ValueError(
            "tma=True needs a device with TMA (compute capability >= 9.0) and inputs with a contiguous head "
            "dim, 16-byte-aligned data and strides that are positive multiples of 16 bytes"
        )
    return strides if possible else None


def tile_descriptor(x: torch.Tensor, strides: list[int], block_rows: int, head_dim_pad: int):
    """A host-built TMA descriptor for (1, 1, block_rows, head_dim_pad) tiles of a (B, H, T, D) tensor.

    Rows past T and columns past D read as zeros, so the kernel needs no load masks on this path. Built
    on the host, the descriptor reaches the kernel as a launch argument; a descriptor built inside the
    kernel costs every program a global-memory write and a fence: on the H200 that lost 5-25 % at
    T = 1k, where host-built descriptors gained up to 21 % at D = 128.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(x, list(x.shape), strides, [1, 1, block_rows, head_dim_pad])
# --8<-- [end:tma]


# --8<-- [start:launch]
# specialisations one launch remembers (devices, alignments); past that it starts over
MAX_COMPILED = 16


def specialization(arg):
    """What Triton compiles a separate kernel for, given one tensor-like argument.

    Triton specialises a tensor on its dtype and on whether its address is a multiple of
    16 bytes, and a TMA descriptor on its tensor's dtype and alignment, its geometry and
    its tile. (Ints and floats are specialised too, but a plan fixes those.) A key finer
    than Triton's only costs an extra trip through the full launch path, never a wrong
    kernel.
    """
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    # a host TMA descriptor: its tensor, geometry and tile
    base = getattr(arg, "base", None)
    if isinstance(base, torch.Tensor):
        return (base.dtype, base.data_ptr() % 16 == 0, tuple(arg.shape),
                tuple(arg.strides), tuple(arg.block_shape), arg.padding)  # fmt: skip
    return arg  # None, for an optional tensor left out


def _launch_hooked() -> bool:
    """Whether a profiler hooks Triton's launches (None or an empty chain of hooks when
    none does)."""
    hook = triton.knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


class KernelLaunch:
    """``kernel[grid](*tensors, *scalars, **constexprs, num_warps=..., ...)``, at a
    fraction of the host cost: one kernel's launch, as a plan works it out once per
    layout.

    Triton's launch path re-binds every argument, rebuilds the specialisation key and
    looks up the device and stream on each call, several times what the compiled
    launcher itself costs (the performance chapter's host times). Everything in that key
    but the tensors' addresses is fixed by the plan that holds this launch, so a call
    only reads each tensor's dtype and 16-byte alignment, finds the compiled kernel kept
    for them, and hands its arguments straight to that kernel's launcher. The first call
    of each specialisation takes Triton's full path and keeps what it compiled. An
    interpreted kernel (TRITON_INTERPRET=1), and a launch a profiler hooks, always take
    the full path.

    ``plan_keyed``: the plan holding this launch is kept under a key with the dtype and
    the 16-byte alignment of every tensor it passes that the caller did not allocate for
    the call (``_plans.layout_key``), and the ones it did allocate are fresh blocks of
    the caching allocator (512-byte aligned) in dtypes the plan fixes. Then every call
    of this launch has one specialisation per device, and the kept kernel is found by
    the device alone, with no per-tensor read.
    """

    __slots__ = ("kernel", "grid", "scalars", "constexprs", "num_warps", "num_stages",
                 "options", "keyed", "plan_keyed", "direct", "_compiled")  # fmt: skip

    def __init__(self, kernel, *, grid: tuple, scalars: tuple, constexprs: dict,
                 num_warps: int, num_stages: int, maxnreg: int | None = None,
                 fresh_outputs: int = 0, plan_keyed: bool = False):  # fmt: skip
        self.kernel, self.grid = kernel, grid
        self.scalars, self.constexprs = scalars, constexprs
        self.num_warps, self.num_stages = num_warps, num_stages
        # The last ``fresh_outputs`` tensors are outputs the caller allocates on every
        # call, in dtypes its plan fixes; the caching allocator aligns every block to
        # 512 bytes, so their specialisation never changes and is left out of the key
        # (two fewer reads of an address per call).
        self.keyed = slice(None, -fresh_outputs if fresh_outputs else None)
        self.plan_keyed = plan_keyed
        # An interpreted kernel (TRITON_INTERPRET=1 when it was defined) is another
        # type, for good: asked once
        self.direct = type(kernel) is triton.JITFunction
        # An option only NVIDIA's backend knows, passed only when set: maxnreg, a cap on
        # registers per thread, so that as many programs share an SM as the settings
        # were measured with.
        self.options = {"maxnreg": maxnreg} if maxnreg else {}
        # (device, specialisation of each tensor), or the device alone -> the kernel's
        # launcher
        self._compiled = {}

    def key(self, tensors, device: int):
        """Which compiled kernel serves these tensors on ``device``: see the class
        docstring."""
        if self.plan_keyed:
            return device
        return (device, *map(specialization, tensors[self.keyed]))

    def __call__(self, *tensors) -> None:
        if not self.direct or _launch_hooked():
            self._full_launch(tensors)
            return
        device = _current_device()
        entry = self._compiled.get(
            device if self.plan_keyed else self.key(tensors, device))
        if entry is None:
            self._compile_and_launch(tensors, device)
            return
        run, function, metadata, tail = entry
        run(*self.grid, _current_stream(device), function, metadata, None, None, None,
            *tensors, *self.scalars, *tail)

    def _full_launch(self, tensors):
        return self.kernel[self.grid](*tensors, *self.scalars, **self.constexprs,
                                      num_warps=self.num_warps,
                                      num_stages=self.num_stages,
                                      **self.options)  # fmt: skip

    def _compile_and_launch(self, tensors, device):
        # compiles (or finds) the kernel, and launches it
        compiled = self._full_launch(tensors)
        if hasattr(compiled, "result"):  # an asynchronous compile
            compiled = compiled.result()
        n_args = len(tensors) + len(self.scalars)
        # the constexprs in declared order
        tail = tuple(self.constexprs[name] for name in self.kernel.arg_names[n_args:])
        if len(self._compiled) >= MAX_COMPILED:
            self._compiled.clear()
        self._compiled[self.key(tensors, device)] = (
            compiled.run, compiled.function, compiled.packed_metadata, tail)


def _stream_handle(device: int) -> int:
    """The raw handle of the current CUDA stream, as Triton's own launch path asks for
    it."""
    return torch.cuda.current_stream(device).cuda_stream


# The current device's index and the raw handle of its current stream, as Triton's own
# launch path asks for them: torch's C functions themselves where this build has them
# (a CUDA build), with no Python frame around them. A launch only runs on tensors
# already on the GPU, so CUDA is initialised and the lazy-init check of
# torch.cuda.current_device has nothing to do.
_current_device = (getattr(torch._C, "_cuda_getDevice", None)
                   or torch.cuda.current_device)
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _stream_handle


# --8<-- [end:launch]


def document_order(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> torch.Tensor:
    """The order in which packed documents' programs launch: int32 document indices on cu_seqlens' device,
    the most (query, key) pairs first, ties in packing order. ``_jit.varlen_program`` reads program b's
    document from it. The GPU starts programs about in launch order, the document axis slowest, so a long
    document packed last would start last and leave a tail of busy SMs; on the benchmark's eight documents
    longest first ran 3 % faster than as packed, shortest first 3 % slower, forward and backward alike
    (bench/results/sweeps/varlen-document-order.json). Worked out on the device (no wait for the GPU) and
    kept while both cu_seqlens are unchanged (``_plans.remember_fact``); any order is a permutation of
    the documents, so a stale one costs speed, never correctness."""
    keys = (cu_seqlens_k, cu_seqlens_k._version, cu_seqlens_k.data_ptr())
    kept = recall_fact("launch order", cu_seqlens_q)
    if kept is not None and kept[0] is keys[0] and kept[1:3] == keys[1:]:
        return kept[3]
    lengths_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int64)
    lengths_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int64)
    order = torch.argsort(lengths_q * lengths_k, descending=True, stable=True).to(torch.int32)
    remember_fact("launch order", cu_seqlens_q, (*keys, order))
    return order
