"""The embeddable API: send and receive from Python code, and the vLLM connector."""
