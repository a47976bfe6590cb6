"""Speculative decoding for transformers causal LMs (imports transformers; `specpass.generate` imports this lazily)."""
