"""The files ``python -m flashtile.practice init DIR`` writes: signatures, docstrings, no solutions.

Each module here is importable (its functions raise NotImplementedError), so the project's own tests
can run the battery against the untouched skeleton and see every step fail with the right hint.
"""
