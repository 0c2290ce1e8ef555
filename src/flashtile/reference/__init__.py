"""Part A: plain PyTorch, exact in float64, one concept per module."""
