"""Training the miniature on seeded synthetic tasks with the DSA recipe (docs/design.md §2).

- ``tasks.py``: the synthetic tasks (pass-key retrieval, copying, image questions), made on the fly.
- ``lean_ops.py``: the training path's ops (grouped experts, chunked KDA, selection masks).
- ``forward.py``: the lean training forward, the same function as ``MiniDSA.forward``.
- ``indexer_losses.py``: the indexer's training signal (KL to the attention, focus loss).
- ``evaluation.py``: retrieval accuracy, indexer recall and multimodal accuracy on held-out seeds.
- ``state.py``: the training state on disk (safetensors + JSON: nothing is unpickled), written atomically.
- ``loop.py``: ``train``: resumable legs, checkpoints, the dense warm-up then sparse stage.
"""

from .evaluation import evaluate
from .loop import TrainConfig, train

__all__ = ["TrainConfig", "evaluate", "train"]
