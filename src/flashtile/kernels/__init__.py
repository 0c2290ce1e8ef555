"""Part B: the Triton kernels, each mirroring a module of ``flashtile.reference``.

Import the submodules directly (``flashtile.kernels.forward``, ``flashtile.kernels.softmax``):
importing them compiles nothing, but on a machine without CUDA, TRITON_INTERPRET=1 must be set
before they are imported for the kernels to run on the CPU.

What the kernels share is written once, in two modules split by where it runs:

- ``_host``: on the host, around a launch: the launcher checks (device, tile sizes, launch settings),
  grid limits (``head_batch_grid``), head-dim padding (``head_dim_pad``), the scale's split into kernel
  units (``kernel_scale``), device probes (``has_tma``), the launch-order heuristic
  (``heaviest_first_chunk``), TMA descriptors and the launch cache (``KernelLaunch``).
- ``_jit``: inside the kernels, the ``@triton.jit`` helpers: the launch order (``program_tile``), the
  online-softmax steps, 64-bit program offsets, tile loads and stores, and the causal tile bounds
  (``last_key_tile``, ``full_key_tiles``, ``first_query_row``).
"""
