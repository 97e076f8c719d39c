"""The routed latent experts: MXFP4 -> FP8 conversion into the workspace and the expert MLPs (docs/design.md §6, §7).

reference.py: the conversion and the FP8 / MXFP4 expert MLPs in plain PyTorch and their checks (mxfp4_to_fp8_ref,
expert_mlp_fp8_ref, expert_mlp_mxfp4_ref);
convert_triton.py: the MXFP4 -> FP8 conversion kernel into workspace slots (mxfp4_to_fp8);
mlp_triton.py: the expert MLP kernels, up, down and combine launches over all slots (expert_mlp_fp8, expert_mlp_mxfp4);
matvec_triton.py: the decode path of those MLPs, matrix-vector products on the FMA units;
dequant_triton.py: in-register dequantisation of FP8 and MXFP4 weight tiles, shared by the two above.
"""
