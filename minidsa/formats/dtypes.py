"""Which dtype each named tensor has in memory and in the checkpoint (docs/design.md §9).

Two different questions, answered by the tensor's name:

* in memory: a bfloat16 model keeps its norms, gates, decay parameters and the indexer's signed
  weights in fp32 (``FP32_IN_MEMORY``), because they are small and their rounding matters;
* on disk: the released checkpoint stores only the KDA conv, ``A_log``, ``dt_bias``, ``o_norm`` and
  the router's correction bias in F32 (``FP32_ON_DISK``), the packed experts as U8, and everything
  else, the router ``gate.weight`` and the other norms included, in the model dtype (BF16).

A float64 model (reference numerics in tests) keeps and stores everything in float64.
"""

from __future__ import annotations

import torch

FP32_IN_MEMORY = ("norm.weight", "k_norm.bias", "weights_proj.weight", "res_proj.weight", "A_log", "dt_bias",
                  "conv1d.weight", "gate.weight", "e_score_correction_bias")
FP32_ON_DISK = ("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias")
SAFETENSORS_NAMES = {torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.float32: "F32",
                     torch.float64: "F64", torch.bfloat16: "BF16", torch.float16: "F16"}


def memory_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """dtype of parameter ``name`` in a model whose compute dtype is ``model_dtype``."""
    if model_dtype != torch.float64 and name.endswith(FP32_IN_MEMORY):
        return torch.float32
    return model_dtype


def disk_dtype(name: str, tensor: torch.Tensor, model_dtype: torch.dtype) -> torch.dtype:
    """dtype tensor ``name`` (of in-memory dtype ``tensor.dtype``) has in a checkpoint of this model."""
    if not tensor.is_floating_point():
        return tensor.dtype  # packed experts and their scales: uint8 everywhere
    if model_dtype != torch.float64 and name.endswith(FP32_ON_DISK):
        return torch.float32
    return model_dtype
