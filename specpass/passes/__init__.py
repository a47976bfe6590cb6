"""One module per rewrite pass; the order they run in is `specpass.pipeline.PASSES`."""
