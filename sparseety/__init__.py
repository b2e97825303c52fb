"""SparSEEty: token-level accounting for LLM serving fleets.

The core package holds what every part shares: the event contract and its wire formats,
configuration, errors, the Kafka plumbing and the command line.
"""

__version__ = "0.1.0"
