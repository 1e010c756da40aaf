"""Erasure codes for the transport (imported as ``kvtransport.codecs``).

- ``gf256``: GF(2^8) arithmetic of RFC 8681 (polynomial 0x11D) with bit-sliced numba region
  kernels (``region_muladd``, ``region_dot``, ``region_scale``, ...).
- ``tinymt32``: the RFC 8682 TinyMT32 generator RFC 8681 draws its coefficients from.
- ``rlc``: the RFC 8681 sliding-window RLC codec: ``coding_coefficients``, ``RLCEncoder`` and
  the on-the-fly Gaussian-elimination ``RLCDecoder``.
- ``blockrs``: a block Reed-Solomon baseline on ``reedsolo`` with the same interface.
- ``quant``: KV-cache block quantization.
"""
