"""Building blocks of the forward pass, in plain PyTorch."""
