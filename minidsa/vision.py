"""Native-resolution vision tower (MoonViT-V2 form) and the projector into the text width (docs/design.md §8).

    image -> RGB, (x / 255 - 0.5) / 0.5, resized to multiples of patch * merge (within a patch budget)
          -> patches [L, 3, P, P] in row-major order -> conv P x P stride P (no bias)
          -> + learned position grid, bilinearly resized to the image's (h, w) patch grid
          -> blocks: x += Attn(RMSNorm(x)) with 2-D RoPE (rows on one half of each head, columns on
             the other), full attention inside one image and never across images;
             x += MLP_gelu_tanh(RMSNorm(x))
          -> final RMSNorm -> concatenate each 2 x 2 patch neighbourhood (4d)
          -> projector: Linear -> GELU -> Linear to the text width -> RMSNorm
Each image gives (h/2) * (w/2) vectors that replace its ``<|media_pad|>`` placeholder in the text.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .norm import RMSNorm
from .ops import acc_dtype

ROPE_THETA = 10000.0  # base of the 2-D rotary frequencies


@dataclass
class PreparedImage:
    """One preprocessed image: patches [h*w, 3, P, P] (row-major) on an h x w patch grid."""

    patches: torch.Tensor
    grid: tuple[int, int]

    @property
    def num_tokens(self) -> int:
        """Text positions this image fills (after the 2 x 2 merge)."""
        return (self.grid[0] // 2) * (self.grid[1] // 2)


def load_image(image, name: str = "image") -> torch.Tensor:
    """numpy / torch HxWx3 (uint8 0..255 or float 0..1), torch 3xHxW, or a PNG/JPEG path -> float [3, H, W] in 0..1."""
    if isinstance(image, (str, os.PathLike)):
        from PIL import Image, UnidentifiedImageError

        path = Path(image)
        if not path.is_file():
            raise ValueError(f"{name}: file {str(path)!r} does not exist")
        try:
            with Image.open(path) as im:
                arr = np.asarray(im.convert("RGB"))
        except (UnidentifiedImageError, OSError) as e:
            raise ValueError(f"{name}: {str(path)!r} is not a readable PNG/JPEG image ({e})") from None
        return torch.from_numpy(arr.copy()).permute(2, 0, 1).float() / 255.0
    if isinstance(image, np.ndarray):
        image = torch.from_numpy(np.ascontiguousarray(image))
    if not isinstance(image, torch.Tensor):
        raise TypeError(f"{name} must be a numpy array, a torch tensor or a file path, got {type(image).__name__}")
    if image.dim() != 3 or (image.shape[-1] != 3 and image.shape[0] != 3):
        raise ValueError(f"{name} has shape {tuple(image.shape)}; it must be an RGB image H x W x 3 (or 3 x H x W). "
                         f"Drop an alpha channel with img[..., :3]; stack a grayscale image three times")
    chw = image.permute(2, 0, 1) if image.shape[-1] == 3 else image
    if image.dtype == torch.uint8:
        return chw.float() / 255.0
    if not image.is_floating_point():
        raise TypeError(f"{name} has dtype {image.dtype}; use uint8 (0..255) or a float type (0..1)")
    if not bool(torch.isfinite(image).all()):
        raise ValueError(f"{name} contains NaN or Inf values")
    if float(image.min()) < 0 or float(image.max()) > 1:
        raise ValueError(f"{name} is a float image with values in [{float(image.min()):.3g}, {float(image.max()):.3g}]; "
                         f"float images must lie in [0, 1] (or pass uint8 0..255)")
    return chw.float()


def target_size(height: int, width: int, patch: int, merge: int, max_patches: int) -> tuple[int, int]:
    """Multiples of patch * merge, as close to the original size as possible, scaled down to fit
    ``max_patches`` patches."""
    if max_patches < merge * merge:
        raise ValueError(f"max_patches = {max_patches} cannot hold even one {merge} x {merge} group of patches")
    unit = patch * merge
    scale = min(1.0, math.sqrt(max_patches * patch * patch / (height * width)))
    h = max(1, round(height * scale / unit))
    w = max(1, round(width * scale / unit))
    while (h * merge) * (w * merge) > max_patches:  # rounding up may overshoot the budget
        if h >= w:
            h -= 1
        else:
            w -= 1
    return h * unit, w * unit


def preprocess(image, cfg: ModelConfig, name: str = "image") -> PreparedImage:
    """Any accepted image -> normalised patches on a grid whose sides are multiples of merge_size."""
    v = cfg.vision
    x = load_image(image, name)
    _, H, W = x.shape
    if H < v.patch_size or W < v.patch_size:
        raise ValueError(f"{name} is {H} x {W} pixels; it must be at least {v.patch_size} x {v.patch_size} "
                         f"(one patch)")
    th, tw = target_size(H, W, v.patch_size, v.merge_size, v.max_patches)
    if (th, tw) != (H, W):
        x = F.interpolate(x.unsqueeze(0), size=(th, tw), mode="bilinear", align_corners=False,
                          antialias=True).squeeze(0).clamp(0, 1)
    x = (x - 0.5) / 0.5
    P = v.patch_size
    h, w = th // P, tw // P
    patches = x.view(3, h, P, w, P).permute(1, 3, 0, 2, 4).reshape(h * w, 3, P, P)
    return PreparedImage(patches, (h, w))


def rope_2d(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, H, hd] (returned in fp32, fp64 kept): the first half of each head by the patch row, the
    second by its column.

    Within each half, rotate-half pairing (i, i + hd/4) with frequency theta^(-4i/hd).
    """
    hd = x.shape[-1]
    quarter = hd // 4
    inv_freq = ROPE_THETA ** (-torch.arange(quarter, dtype=torch.float64, device=x.device) / quarter)

    acc = acc_dtype(x)
    x = x.to(acc)

    def rotate(part, pos):
        ang = (pos.double().unsqueeze(-1) * inv_freq).to(acc)
        cos, sin = ang.cos().unsqueeze(1), ang.sin().unsqueeze(1)  # [N, 1, quarter]
        a, b = part[..., :quarter], part[..., quarter:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    return torch.cat([rotate(x[..., : hd // 2], rows), rotate(x[..., hd // 2:], cols)], dim=-1)


class VisionBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        v = cfg.vision
        self.num_heads, self.head_dim = v.num_heads, v.head_dim
        inner = v.num_heads * v.head_dim
        self.norm1 = RMSNorm(v.hidden_size, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(v.hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(v.hidden_size, inner, bias=False)
        self.v_proj = nn.Linear(v.hidden_size, inner, bias=False)
        self.o_proj = nn.Linear(inner, v.hidden_size, bias=False)
        self.norm2 = RMSNorm(v.hidden_size, cfg.rms_norm_eps)
        self.fc1 = nn.Linear(v.hidden_size, v.intermediate_size)
        self.fc2 = nn.Linear(v.intermediate_size, v.hidden_size)

    def forward(self, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, same_image: torch.Tensor):
        """x [N, d] (all images packed), rows/cols [N] patch coordinates, same_image bool [N, N]."""
        N = x.shape[0]
        h = self.norm1(x)
        q = rope_2d(self.q_proj(h).view(N, self.num_heads, self.head_dim), rows, cols)
        k = rope_2d(self.k_proj(h).view(N, self.num_heads, self.head_dim), rows, cols)
        v = self.v_proj(h).view(N, self.num_heads, self.head_dim).to(q.dtype)  # attention math in fp32 (fp64 kept)
        s = torch.einsum("nhd,mhd->hnm", q, k) * self.head_dim ** -0.5
        s = s.masked_fill(~same_image, float("-inf"))  # full attention inside an image, never across
        o = torch.einsum("hnm,mhd->nhd", torch.softmax(s, dim=-1), v).reshape(N, -1)
        x = x + self.o_proj(o.to(x.dtype))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class VisionTower(nn.Module):
    """``vision_tower``: patches of several images -> per-image merged features [h/2 * w/2, 4d]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        v = cfg.vision
        self.merge = v.merge_size
        self.patch_embed = nn.Conv2d(3, v.hidden_size, v.patch_size, stride=v.patch_size, bias=False)
        self.pos_emb = nn.Parameter(torch.zeros(v.position_grid, v.position_grid, v.hidden_size))
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(v.num_layers))
        self.final_norm = RMSNorm(v.hidden_size, cfg.rms_norm_eps)

    def positions(self, h: int, w: int) -> torch.Tensor:
        """The learned grid bilinearly resized to h x w -> [h*w, d]."""
        grid = self.pos_emb.permute(2, 0, 1).unsqueeze(0).float()  # [1, d, G, G]
        grid = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=False)
        return grid[0].permute(1, 2, 0).reshape(h * w, -1)

    def forward(self, images: list[PreparedImage]) -> list[torch.Tensor]:
        dtype = self.patch_embed.weight.dtype
        xs, rows, cols, owner = [], [], [], []
        for i, im in enumerate(images):
            h, w = im.grid
            x = self.patch_embed(im.patches.to(dtype)).flatten(1)  # [h*w, d]
            xs.append(x + self.positions(h, w).to(dtype))
            r, c = torch.meshgrid(torch.arange(h, device=x.device), torch.arange(w, device=x.device), indexing="ij")
            rows.append(r.reshape(-1))
            cols.append(c.reshape(-1))
            owner.append(torch.full((h * w,), i, device=x.device))
        x = torch.cat(xs)
        rows, cols, owner = torch.cat(rows), torch.cat(cols), torch.cat(owner)
        same_image = owner.unsqueeze(0) == owner.unsqueeze(1)
        for block in self.blocks:
            x = block(x, rows, cols, same_image)
        x = self.final_norm(x)
        out, start = [], 0
        m = self.merge
        for im in images:
            h, w = im.grid
            feat = x[start: start + h * w].view(h // m, m, w // m, m, -1)
            out.append(feat.permute(0, 2, 1, 3, 4).reshape((h // m) * (w // m), -1))  # 2x2 neighbours, row-major
            start += h * w
        return out


class MultimodalProjector(nn.Module):
    """``mm_projector``: merged features [n, 4d_vision] -> text embeddings [n, d_text]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        v = cfg.vision
        self.linear_1 = nn.Linear(v.hidden_size * v.merge_size ** 2, v.projector_hidden_size)
        self.linear_2 = nn.Linear(v.projector_hidden_size, cfg.hidden_size)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear_2(F.gelu(self.linear_1(x))))
