"""The demo and its links: the emulated link, the netns testbed, the TCP baseline."""
