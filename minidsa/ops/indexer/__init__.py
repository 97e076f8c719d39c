"""The DSA lightning indexer: index scores over the paged key plane and causal top-k (docs/design.md §2).

reference.py: index_scores_ref, paged_index_scores_ref, topk_indices_ref;
checks.py: the argument checks every form shares;
scores_triton.py: the fused paged-scores kernel, ReLU and head sum in registers (paged_index_scores, index_scores);
topk_triton.py: the exact radix-select top-k over many programs per row, then a sort of the selected keys (topk_indices);
topk_cpu.py: the same top-k on CPU tensors as torch.topk over one int64 key per (score, position) pair;
scores_cpu.py: the paged scores on CPU tensors, each padded prompt row only up to its causal bound.
"""
