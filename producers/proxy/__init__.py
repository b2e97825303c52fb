"""producers/proxy."""
