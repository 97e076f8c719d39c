"""SiTU-GLU, the activation of every MLP and expert (docs/design.md §6).

reference.py: the expression and its derivative in plain PyTorch (situ_glu_ref, situ_glu_backward_ref, situ_glu_values);
situ_glu_triton.py: one fused elementwise Triton pass each for the forward and the backward (situ_glu, situ_glu_backward).
"""
