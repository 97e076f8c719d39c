"""Block Attention Residuals: the softmax-over-depth mixer (docs/design.md §1).

reference.py: one mixer over its sources (attn_res_mix_ref) and the two phases of Block AttnRes, scores
against the stored blocks and the online-softmax merge with the partial sum (attn_res_block_scores, attn_res_merge).
"""
