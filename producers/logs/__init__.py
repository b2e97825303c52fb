"""producers/logs."""
