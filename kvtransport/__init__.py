"""kvtransport: FEC-protected KV-cache transport for multi-agent LLM handoffs."""

__version__ = "0.1.0"
