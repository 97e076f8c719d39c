"""Kimi Delta Attention, the gated delta rule over a per-head fp32 state (docs/design.md §5).

reference.py: the recurrence and its chunked WY/UT form in plain PyTorch (kda_recurrent_ref, kda_chunk_ref), and a
decode step from the layer's projections (kda_decode_ref);
recurrent_triton.py: the fused recurrence kernel (kda_recurrent);
decode_triton.py: that kernel with the decode step's norms, gates and state-slot read built in (kda_decode);
chunk_triton.py: the five kernels of the chunked form, the prefill path (kda_chunk);
io_triton.py: what both share: state-tile and token-row loads, output allocation, fp64 inputs to the reference.
"""
