"""The model zoo: draft architectures specpass is proven on (plain PyTorch, not installed)."""
