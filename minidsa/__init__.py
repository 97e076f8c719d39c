"""minidsa: a readable miniature of a Kimi-K3 / DeepSeek-V3.2-class sparse-attention model.

    import minidsa
    print(minidsa.generate("hello", max_new_tokens=16, temperature=0))
    model = minidsa.load("laptop")
    logits = model(torch.tensor([[256, 104, 105]]))   # one full forward, no cache
"""

from . import ops
from .config import ModelConfig, load_config, preset_names
from .generate import GenerationStream, GenerationTrace, default_model, generate, load
from .kv_cache import CacheLayout, OutOfKVBlocksError, PagedKVCache, Plane
from . import mxfp4
from .model import ForwardTrace, MiniDSA, build_model, count_parameters
from .tokenizer import ByteTokenizer

__version__ = "0.1.0"

__all__ = [
    "ops", "ModelConfig", "load_config", "preset_names", "generate", "load", "default_model",
    "GenerationStream", "GenerationTrace", "CacheLayout", "OutOfKVBlocksError", "PagedKVCache", "Plane",
    "MiniDSA", "ForwardTrace", "build_model", "count_parameters", "ByteTokenizer", "mxfp4",
]
