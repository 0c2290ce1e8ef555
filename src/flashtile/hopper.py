"""The Hopper numbers the Triton primer teaches (docs/part-b/triton-primer.md), and two counts made from them.

* ``H100``, ``H200``: a ``GPU`` each, the per-SM limits of compute capability 9.0 (the same on both
  chips: CUDA C Programming Guide, "Technical Specifications per Compute Capability") and each chip's
  SM count and HBM peak (NVIDIA's data sheets, SXM parts). Data sheet numbers, not measurements: what
  this repository measured lives in ``bench/results/``.
* ``programs_per_sm``: how many programs of a launch one SM can hold at once, and which resource
  runs out first (registers, shared memory or threads).
* ``waves``: how many rounds of programs a grid needs, ``ceil(programs / (SMs * programs per SM))``.

Pure Python: no GPU, no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._env import H200_SM_COUNT


# --8<-- [start:gpu]
@dataclass(frozen=True)
class GPU:
    name: str
    sms: int  # streaming multiprocessors: each runs programs on its own
    hbm_tbps: float  # the HBM's peak read bandwidth, data sheet, TB/s
    warp: int = 32  # threads that issue one instruction together
    warps_per_warpgroup: int = 4  # a wgmma matmul is issued by 4 warps at once
    registers_per_sm: int = 65_536  # 32-bit registers, shared by every thread on the SM
    max_registers_per_thread: int = 255  # past this the compiler spills to local memory
    register_unit: int = 8  # a thread's registers are handed out in steps of 8
    # bytes; one program may use up to 227 KiB of it
    shared_memory_per_sm: int = 228 * 1024
    max_threads_per_sm: int = 2048
    max_programs_per_sm: int = 32

    @property
    def warpgroup(self) -> int:
        """Threads in a warpgroup: 4 warps of 32."""
        return self.warps_per_warpgroup * self.warp


H100 = GPU("H100 SXM", sms=H200_SM_COUNT, hbm_tbps=3.35)  # the same 132 SMs as the H200
H200 = GPU("H200 SXM", sms=H200_SM_COUNT, hbm_tbps=4.8)
# --8<-- [end:gpu]


# --8<-- [start:occupancy]
def programs_per_sm(
    num_warps: int, registers: int, shared_bytes: int, gpu: GPU = H200
) -> tuple[int, str]:
    """(programs one SM holds at once, the resource that limits it) for a launch of
    ``num_warps`` warps a program, ``registers`` 32-bit registers a thread and
    ``shared_bytes`` of shared memory a program."""
    if not 1 <= registers <= gpu.max_registers_per_thread:
        raise ValueError(
            f"{registers} registers a thread: the compiler spills past "
            f"{gpu.max_registers_per_thread}"
        )
    threads = num_warps * gpu.warp
    # 255 is allocated as 256
    per_thread = -(-registers // gpu.register_unit) * gpu.register_unit
    limits = {
        "registers": gpu.registers_per_sm // (threads * per_thread),
        "shared memory": gpu.shared_memory_per_sm // max(shared_bytes, 1),
        "threads": gpu.max_threads_per_sm // threads,
        "programs": gpu.max_programs_per_sm,
    }
    limit = min(limits, key=limits.get)  # the first of the scarcest, in this order
    return limits[limit], limit


def waves(programs: int, per_sm: int, gpu: GPU = H200) -> int:
    """Rounds of programs a grid needs when each SM holds ``per_sm`` at a time."""
    return -(-programs // (gpu.sms * per_sm))
# --8<-- [end:occupancy]
