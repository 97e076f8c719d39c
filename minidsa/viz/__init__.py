"""Pictures of what the model did and of what it costs (matplotlib). Every plotting function returns a Figure
(nothing is shown or saved) and takes ``ax=None`` (``fig=None`` when it needs several panels); the data helpers
return numpy arrays, floats or dicts that tests and notebooks can assert on.

- ``tokens.py``: a printable label per token id for tick marks, and the positions spelling a text.
- ``selection.py``: DSA picks, lightning-indexer scores and recall of an MLA layer, from a ``GenerationTrace``.
- ``depth.py``: the Block AttnRes depth weights of a ``GenerationTrace``.
- ``kda.py``: KDA gates and state norms per token, and KDA state vs KV-cache memory against context.
- ``moe.py``: expert load and routing, and the shared FP8 expert workspace.
- ``mxfp4.py``: the E2M1 values, MXFP4 round-trip error, and expert bytes per format.
- ``cache.py``: the paged KV cache's block tables.
- ``step.py``: one packed engine step: its token axis, pieces, blocks and state slots.
- ``budget.py``: the memory budget of a config at a context length.
- ``training.py``: the losses of a training run, its stages marked.
"""

from .budget import memory_budget, plot_memory_budget
from .cache import plot_block_tables
from .depth import depth_weight_matrix, plot_depth_weights, source_names
from .kda import kda_gates, plot_kda_gates, plot_state_memory, state_memory
from .moe import expert_load, expert_routing, plot_expert_load, plot_routed_experts, plot_workspace, workspace_bytes
from .mxfp4 import (
    expert_format_bytes,
    plot_format_bytes,
    plot_mxfp4_values,
    plot_quantisation_error,
    relative_error,
    round_trip,
)
from .selection import (
    indexer_scores,
    pick_share,
    plot_index_scores,
    plot_recall,
    plot_selection,
    random_pick_share,
    selection_matrix,
    selection_recall,
)
from .step import plot_packed_step, step_table
from .tokens import find_span, token_labels
from .training import load_history, plot_training_curves, stage_spans

__all__ = [
    # tokens, selection, depth
    "depth_weight_matrix", "find_span", "indexer_scores", "pick_share", "plot_depth_weights", "plot_index_scores",
    "plot_recall", "plot_selection", "random_pick_share", "selection_matrix", "selection_recall", "source_names",
    "token_labels",
    # kda, moe, mxfp4, cache, step, budget, training
    "kda_gates", "plot_kda_gates", "plot_state_memory", "state_memory",
    "expert_load", "expert_routing", "plot_expert_load", "plot_routed_experts", "plot_workspace", "workspace_bytes",
    "expert_format_bytes", "plot_format_bytes", "plot_mxfp4_values", "plot_quantisation_error", "relative_error",
    "round_trip",
    "plot_block_tables", "plot_packed_step", "step_table",
    "memory_budget", "plot_memory_budget",
    "load_history", "plot_training_curves", "stage_spans",
]
