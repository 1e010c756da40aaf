"""The model side: KV caches, blocks, cards, utility, the planner, the race, injection."""
