"""The protocol core, sans-I/O: wire format, sender and receiver sessions, policy."""
