"""The sigmoid output gate of the attention layers (KDA and gated MLA), with KDA's per-head norm.

reference.py: the formula in the accumulation dtype (output_gate_ref); gate_triton.py: one pass per tile of
(token, head) rows, instead of a cast, a sigmoid, a norm, a product and a cast.
"""
