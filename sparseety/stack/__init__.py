"""The embedded stack (``sparseety up/down/status``) and the demo (``sparseety demo``)."""
