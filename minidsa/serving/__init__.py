"""Turning requests into text (docs/design.md §4, §16).

- ``requests.py``: a ``generate()`` call checked and encoded into a request (prompts, images, limits).
- ``sampling.py``: the next token from the logits (greedy, temperature, top-k, top-p).
- ``generation.py``: ``generate`` and ``stream``: prefill each prompt into the paged cache, then decode the batch.
- ``params.py``: ``SamplingParams``, ``RequestOutput`` and its ``RequestMetrics`` (vLLM's names).
- ``prefix_cache.py``: named full KV blocks and KDA checkpoints; hits clamped to a checkpoint.
- ``scheduler.py``: continuous batching under a token budget, admission, recompute preemption.
- ``sharing.py``: generate() calls of several threads on one cache, admitted in turn as room comes back.
- ``budget.py``: the cache sized from a memory budget that counts every pool and workspace.
- ``engine.py``: ``Engine``: add_request / step / abort / generate / stats; NaN/inf logits fail a request.
"""

from .engine import Engine, NonFiniteLogitsError
from .generation import Generation, GenerationStream, generate, stream
from .params import RequestMetrics, RequestOutput, SamplingParams
from .requests import RequestError
from .sampling import sample_next_token

__all__ = ["Engine", "Generation", "GenerationStream", "NonFiniteLogitsError", "RequestError", "RequestMetrics",
           "RequestOutput", "SamplingParams", "generate", "sample_next_token", "stream"]
