"""Reference sparse attention on dense tensors: each query attends to an explicit list of key positions.

This is the form a reader learns first, and the contract of every sparse attention path: it equals
the masked-dense reference (``masked_dense_attention`` with ``indices_to_mask``): scores over all
keys, -inf outside the selected set, softmax, weighted sum. Index -1 marks padding and is never
dereferenced. The paged MLA ops (minidsa/ops/mla/) are tested against this one.
"""

from __future__ import annotations

import torch

from .._checks import acc_dtype, check_tensor
from .._denormals import floored_exp
from .._dispatch import op
from .checks import check_sparse_args


def gather_rows(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """rows[b, n] = src[b, idx[b, n]] for idx >= 0, and 0 where idx == -1.

    Args:
        src: [B, S, *F]; idx: integer [B, N]. Returns [B, N, *F] in src.dtype.
    A padded entry reads a clamped row and discards it with a select; multiplying row 0 by zero
    instead would turn a NaN stored there into NaN output (docs/design.md §10, trap 4).
    """
    B, N = idx.shape
    safe = idx.long().clamp_min(0)
    rows = src[torch.arange(B, device=idx.device).unsqueeze(1), safe]  # [B, N, *F]
    keep = (idx >= 0).view(B, N, *([1] * (src.dim() - 2)))
    return torch.where(keep, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def masked_softmax(s: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of scores ``s`` where ``valid`` (broadcastable bool) is True, 0 elsewhere.

    A row with no valid entry gets zeros (not NaN); a NaN score at a valid entry still propagates.
    """
    s = s.masked_fill(~valid, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all-masked rows: avoid -inf - -inf
    # Masked entries zeroed by a product, not by exp(-inf), the CPU's slow path (ops/_denormals.py).
    p = floored_exp(s - m) * valid.to(s.dtype)
    denom = p.sum(dim=-1, keepdim=True)
    return p / torch.where(denom > 0, denom, torch.ones_like(denom))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of each query over its own K gathered keys.

    q [B, T, H, Dk]; k [B, T, K, Hkv, Dk]; v [B, T, K, Hkv, Dv] (Hkv in {1, H}); valid bool [B, T, K]
    -> [B, T, H, Dv] in q's dtype. Invalid keys get -inf; a query with no valid key gets zeros.
    """
    H = q.shape[2]
    s = torch.einsum("bthd,btkhd->bthk", q, k.expand(-1, -1, -1, H, -1)) * float(scale)
    p = masked_softmax(s, valid.unsqueeze(2))
    return torch.einsum("bthk,btkhd->bthd", p, v.expand(-1, -1, -1, H, -1))


@op()
def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Attention of each query over only the key positions listed in ``indices``.

    Args:
        q: [B, T, H, Dk] queries.
        k: [B, S, Hkv, Dk] keys; Hkv == H (decompressed MHA form) or Hkv == 1 (one latent key shared
           by all heads: the absorbed / MQA form of MLA decode).
        v: [B, S, Hkv, Dv] values, same Hkv as k.
        indices: integer [B, T, K] key positions in [0, S) or -1 (padding). Every head of a query uses
           the same set. Entries must be distinct apart from -1 (top-k output is).
        scale: softmax scale applied to q.k.
    Returns:
        [B, T, H, Dv] float32 (float64 if an input is). A query whose indices are all -1 gets zeros.
    Out-of-range indices are rejected when they are in CPU memory (elsewhere the check would cost a
    device sync per call).
    """
    B, T, H, Dk, S, Hkv, K = check_sparse_args(q, k, v, indices)
    acc = acc_dtype(q, k, v)
    flat = indices.reshape(B, T * K)
    kg = gather_rows(k.to(acc), flat).view(B, T, K, Hkv, Dk)
    vg = gather_rows(v.to(acc), flat).view(B, T, K, Hkv, -1)
    return attend(q.to(acc), kg, vg, indices >= 0, scale)


def indices_to_mask(indices: torch.Tensor, num_keys: int) -> torch.Tensor:
    """bool [B, T, S] with True at every selected position; -1 entries select nothing."""
    B, T, _ = check_tensor("indices", indices, ndim=3, integer=True)
    mask = torch.zeros(B, T, num_keys + 1, dtype=torch.bool, device=indices.device)
    # -1 is sent to the extra column num_keys, which is dropped.
    idx = torch.where(indices >= 0, indices.long(), torch.full_like(indices, num_keys, dtype=torch.long))
    mask.scatter_(-1, idx, True)
    return mask[..., :num_keys]


def masked_dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """The plain reference: dense scores over all S keys, -inf where ``mask`` is False.

    Args: q [B, T, H, Dk]; k [B, S, Hkv, Dk]; v [B, S, Hkv, Dv]; mask bool [B, T, S].
    Returns: [B, T, H, Dv] float32; fully masked rows give zeros.
    """
    B, T, H, _ = check_tensor("q", q, ndim=4, floating=True)
    S = k.shape[1]
    check_tensor("mask", mask, shape=(B, T, S))
    acc = acc_dtype(q, k, v)
    kf = k.to(acc).expand(-1, -1, H, -1)
    vf = v.to(acc).expand(-1, -1, H, -1)
    s = torch.einsum("bthd,bshd->bths", q.to(acc), kf) * float(scale)
    return torch.einsum("bths,bshd->bthd", masked_softmax(s, mask.unsqueeze(2)), vf)


# The plain references by the names the kernels' fallbacks and the tests call them.
sparse_attention_ref = sparse_attention.reference
