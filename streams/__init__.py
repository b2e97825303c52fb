"""Stream processing: fold engine events into per-request token accounting and usage windows."""
