"""One endpoint above its sessions, sans-I/O: the hosts and their link sharing."""
