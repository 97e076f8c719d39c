"""The model's nn.Modules, in reading order (docs/design.md §1-§8):

- ``norm.py``, ``ffn.py``: RMSNorm and the SiTU-GLU MLP.
- ``indexer.py``: the DSA lightning indexer (scores every past token, keeps the top k).
- ``mla.py``: Gated MLA with DeepSeek Sparse Attention, prefill and decode forms.
- ``kda.py``: the Kimi Delta Attention layer (short convs, gated delta rule, recurrent state).
- ``moe.py``: the latent mixture of experts and the shared FP8 expert workspace.
- ``vision.py``: the native-resolution vision tower and its projector.
- ``decoder.py``: the layer stack wired by Block Attention Residuals.
- ``initialization.py``: seeded initial weights.
- ``minidsa.py``: the whole model ``MiniDSA`` (embeddings, decoder, head, cache, save).
- ``trace.py``: records of what sparse attention selected and how depth was mixed.
"""

from .minidsa import MiniDSA
from .trace import ForwardTrace, GenerationTrace

__all__ = ["ForwardTrace", "GenerationTrace", "MiniDSA"]
