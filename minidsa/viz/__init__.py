"""Pictures of what the model did, from a ``GenerationTrace`` (matplotlib)."""

from .plots import depth_weight_matrix, plot_depth_weights, plot_selection, selection_matrix

__all__ = ["depth_weight_matrix", "plot_depth_weights", "plot_selection", "selection_matrix"]
