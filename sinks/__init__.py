"""Sinks: write the stream outputs to stores, batched per partition and idempotent."""
