"""RMSNorm, the norm before every sub-layer and inside MLA and the MoE (docs/design.md §1).

reference.py: the formula in the accumulation dtype, returned in the input's dtype (rms_norm_ref);
rms_triton.py: one pass per row tile, the casts in registers (rms_norm).
"""
