"""Benchmarks: flashtile's kernels against PyTorch SDPA's backends (and flex and naive attention where
they run) in one process, one run.

Run on a CUDA machine from the repository root:

    python -m flashtile.bench                          # every table
    python -m flashtile.bench --help                   # the tables: forward, overhead, backward, softmax,
                                                       # decode, train_step
    python -m flashtile.bench forward --set main       # one shape set of one table
    python -m flashtile.bench forward --sweep          # a launch-config sweep of the forward kernel

Results are JSON with provenance (GPU, versions, date, commit) under ``bench/results/``, in the schema
every table shares; the site renders its tables and plots from those files (``hooks/render_tables.py``,
``hooks/render_plots.py``; ``python hooks/render_tables.py`` re-renders the pages' tables after a run),
so it builds without a GPU.
"""
