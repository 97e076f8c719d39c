"""minidsa: a readable miniature of a Kimi-K3 / DeepSeek-V3.2-class sparse-attention model.

    import minidsa
    print(minidsa.generate("hello", max_new_tokens=16, temperature=0))
    model = minidsa.load("laptop")
    logits = model(torch.tensor([[256, 104, 105]]))   # one full forward, no cache
    minidsa.train(minidsa.TrainConfig(model="tiny", out_dir="runs/tiny"))   # the synthetic tasks, DSA recipe

The design document, mechanism by mechanism: docs/design.md in the repository.
"""

from . import ops
from .acceptance import DoctorReport, doctor
from .cache import CacheContext, CacheLayout, OutOfKVBlocksError, PagedKVCache, Plane
from .checkpoint import (
                         CheckReport,
                         Finding,
                         build_model,
                         check_checkpoint,
                         checkpoint_manifest,
                         count_parameters,
                         default_model,
                         load,
)
from .config import ModelConfig, load_config, preset_names
from .formats import mxfp4
from .model import ForwardTrace, GenerationTrace, MiniDSA
from .serving import Engine, Generation, GenerationStream, RequestOutput, SamplingParams, generate, sample_next_token, stream
from .tokenizer import ByteTokenizer
from .training import TrainConfig, evaluate, train

__version__ = "0.1.0"

__all__ = [
    "ops", "mxfp4", "ModelConfig", "load_config", "preset_names", "generate", "stream", "load", "default_model",
    "Generation", "GenerationStream", "GenerationTrace", "CacheContext", "CacheLayout", "OutOfKVBlocksError", "PagedKVCache",
    "Plane", "MiniDSA", "ForwardTrace", "build_model", "count_parameters", "ByteTokenizer", "sample_next_token",
    "checkpoint_manifest", "check_checkpoint", "CheckReport", "Finding", "train", "TrainConfig", "evaluate",
    "Engine", "SamplingParams", "RequestOutput", "doctor", "DoctorReport",
]
