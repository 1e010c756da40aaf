"""The real-socket shells: UDP, the daemons and their ZeroMQ API and client."""
