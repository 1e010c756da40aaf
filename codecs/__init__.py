"""Erasure codes for the transport (imported as ``kvtransport.codecs``).

- ``gf256``: GF(2^8) arithmetic of RFC 8681 (polynomial 0x11D) with numba region kernels
  (GFNI, split-nibble shuffle or bit-sliced, picked at import: ``region_muladd``,
  ``region_muladd_multi``, ``region_dot``, ``region_scale``, ...).
- ``tinymt32``: the RFC 8682 TinyMT32 generator RFC 8681 draws its coefficients from.
- ``rlc``: the RFC 8681 sliding-window RLC codec: ``coding_coefficients``, ``RLCEncoder``
  (``repairs_into``: several repairs in one pass) and the on-the-fly Gaussian-elimination
  ``RLCDecoder`` (``add_packets``: a run of packets per call).
- ``blockrs``: a block Reed-Solomon baseline on ``reedsolo`` with the same interface.
- ``quant``: KV-cache block quantization (int8, int4, and K and V at their own bits: k8v4).
- ``kvcodec``: an entropy-coded KV block codec (per-head uniform steps, per-channel anchors
  across a block's tokens, interleaved rANS with the block's own frequency table).
"""
