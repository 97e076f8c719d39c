"""Sizing the engine's cache from a memory budget that counts every pool (docs/design.md §16).

The cache is not the only thing a step needs: besides the weights there are the KDA state slots, the
prefix cache's KDA checkpoints, the shared FP8 expert workspace and the prefill's transient workspaces
(the indexer's scores of every query against every key, the sparse prefill's block-union masks and the
logits). Those are taken out of the budget first; what is left, in whole KV blocks, is the cache. The
plan says which limit bounds the block count, so a user knows what to raise.
"""

from __future__ import annotations

import torch

from ..model.experts import ExpertWorkspace
from ..model.minidsa import MiniDSA

CUDA_MEMORY_FRACTION = 0.9  # of the free device memory; the rest is headroom for the allocator


def plan_cache(model: MiniDSA, max_num_seqs: int, max_num_batched_tokens: int, max_checkpoints: int,
               num_blocks: int | None, memory_bytes: int | None) -> dict:
    """Bytes of each pool and workspace, and ``num_blocks`` with the limit that bounds it (``bound``)."""
    cfg = model.config
    layout = model.cache_layout(1)
    state = layout.state_bytes_per_sequence()
    tokens, ctx, bs = max_num_batched_tokens, cfg.max_seq_len, cfg.kv_block_size
    plan = {
        "kv_block_bytes": layout.bytes_per_token() * bs,
        "kda_state_pool_bytes": max_num_seqs * state,  # one slot per sequence the engine may run
        "kda_checkpoint_bytes": max_checkpoints * state,
        "expert_workspace_bytes": ExpertWorkspace(cfg, "meta").nbytes,
        # Per MLA layer call, one at a time: fp32 scores per indexer head and their sum, [tokens, ctx].
        "indexer_scores_bytes": tokens * ctx * 4 * (cfg.indexer.num_heads + 1),
        "union_mask_bytes": tokens * -(-ctx // bs),
        "logits_bytes": tokens * cfg.vocab_size * 4,
    }
    fixed = sum(v for k, v in plan.items() if k != "kv_block_bytes")
    needed = max_num_seqs * -(-ctx // bs)  # every sequence at full length
    if num_blocks is not None:
        plan.update(num_blocks=num_blocks, bound="num_blocks argument")
    else:
        if memory_bytes is None and model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(model.device)
            memory_bytes = int(free * CUDA_MEMORY_FRACTION)
        if memory_bytes is None:
            plan.update(num_blocks=cfg.kv_num_blocks, bound="config kv_num_blocks")
        else:
            fit = (memory_bytes - fixed) // plan["kv_block_bytes"]
            if fit < 1:
                raise ValueError(f"memory_bytes = {memory_bytes} leaves no room for a KV block after the state pool, "
                                 f"checkpoints and workspaces ({fixed} bytes); raise it or lower "
                                 f"max_num_batched_tokens / max_checkpoints")
            plan.update(num_blocks=min(fit, needed),
                        bound="memory" if fit < needed else "max_num_seqs x max_seq_len")
    plan["memory_bytes"] = memory_bytes
    plan["total_bytes"] = fixed + plan["num_blocks"] * plan["kv_block_bytes"]
    return plan
