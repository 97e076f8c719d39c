"""Kimi Delta Attention, the gated delta rule over a per-head fp32 state (docs/design.md §5).

reference.py: the recurrence and its chunked WY/UT form in plain PyTorch (kda_recurrent_ref, kda_chunk_ref), the
short conv (causal_conv), and a decode step from the layer's input products (kda_decode_ref);
recurrent_triton.py: the fused recurrence kernel (kda_recurrent);
decode_triton.py: that kernel with the decode step's short convs, decay projection, norms, gates and state-slot
reads built in (kda_decode);
chunk_triton.py: the five kernels of the chunked form, the prefill path (kda_chunk);
chunk_host.py: their scratch tensors and the table of states to keep (prefix-cache checkpoints);
io_triton.py: what both share: state-tile and token-row loads, output allocation, fp64 inputs to the reference.
"""
