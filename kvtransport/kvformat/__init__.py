"""The KV cache's format, torch-free: caches as numpy arrays (kvcache), cut into blocks of
one layer x one token range with their manifest and precisions (blocks), and stored as cache
cards (card). The daemons read it without loading a model; the model side (kvtransport.model)
builds and consumes it.
"""
