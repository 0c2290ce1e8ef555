"""Part B: the Triton kernels, each mirroring a module of ``flashtile.reference``.

Import the submodules directly (``flashtile.kernels.forward``, ``flashtile.kernels.softmax``):
importing them compiles nothing, but on a machine without CUDA, TRITON_INTERPRET=1 must be set
before they are imported for the kernels to run on the CPU.
"""
