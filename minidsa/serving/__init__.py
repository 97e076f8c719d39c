"""Turning requests into text (docs/design.md §4).

- ``requests.py``: a ``generate()`` call checked and encoded into a request (prompts, images, limits).
- ``sampling.py``: the next token from the logits (greedy, temperature, top-p).
- ``generation.py``: ``generate``: prefill each prompt into the paged cache, then decode the batch.
"""

from .generation import GenerationStream, generate
from .sampling import sample_next_token

__all__ = ["GenerationStream", "generate", "sample_next_token"]
