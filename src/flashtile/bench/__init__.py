"""Part B benchmarks: flashtile's kernels against PyTorch SDPA (cuDNN and flash backends) in one run.

Run on a CUDA machine from the repository root:

    python -m flashtile.bench                      # forward, backward and softmax tables
    python -m flashtile.bench forward --sweep      # one table, or a launch-config sweep

Results are JSON with provenance (GPU, versions, date, commit) under ``bench/results/``; the site
renders its tables from those files, so it builds without a GPU.
"""
