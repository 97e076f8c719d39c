"""A KDA layer's step around the recurrence of ``ops/kda`` (docs/design.md §5).

reference.py: the short convs with SiLU (causal_conv, short_conv_ref), the per-token inputs (kda_step_inputs,
kda_inputs_ref) and the fused decode step (kda_decode_ref);
checks.py: the argument checks every form shares;
conv_triton.py: the short convs and SiLU in one pass (short_conv);
inputs_triton.py: the norms, decay and write strength in one pass (kda_inputs);
decode_triton.py: the recurrent kernel's step with the convs, the decay projection, the norms, the gates and the
state-slot reads built in (kda_decode).
"""
