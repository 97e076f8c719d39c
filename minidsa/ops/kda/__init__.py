"""Kimi Delta Attention, the gated delta rule over a per-head fp32 state (docs/design.md §5).

reference.py: the recurrence and its chunked WY/UT form in plain PyTorch (kda_recurrent_ref, kda_chunk_ref);
checks.py: the argument checks every form shares;
recurrent_triton.py: the fused recurrence kernel (kda_recurrent);
chunk_triton.py: the five kernels of the chunked form, the prefill path (kda_chunk);
chunk_cpu.py: the chunked form on CPU tensors with the factored sub-chunk sums;
chunk_host.py: the chunk kernels' scratch tensors and the table of states to keep (prefix-cache checkpoints);
io_triton.py: what both kernel families share: state-tile and token-row loads, output allocation, fp64 inputs to
the reference.
The short convs, the per-token inputs and the fused decode step around the recurrence: ``ops/kda_step``.
"""
