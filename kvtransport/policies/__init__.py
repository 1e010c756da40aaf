"""Repair policies above the protocol core's interface (kvtransport.core.policy_base).

``heuristics``: the built-in rules (none, fixed-rate RLC, block RS, ARQ, the tail rule,
adaptive); ``ddqn``: the shipped Double-DQN's numpy/numba runtime and its weights;
``features``: that network's input kernel; ``registry``: names -> policies. The data plane
loads these without torch or the training package (kvtransport.agents).
"""
