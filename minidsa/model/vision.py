"""Native-resolution vision tower (MoonViT-V2 form) and the projector into the text width (docs/design.md §8).

    image -> RGB, (x / 255 - 0.5) / 0.5, resized to multiples of patch * merge (within a patch budget)
          -> patches [L, 3, P, P] in row-major order -> conv P x P stride P (no bias)
          -> + learned position grid, bilinearly resized to the image's (h, w) patch grid
          -> blocks: x += wo Attn(fused wqkv(RMSNorm(x))) with 2-D RoPE on interleaved channel pairs
             (even pairs by the patch column, odd pairs by its row), full attention inside one image
             and never across images; x += fc1(GELU_tanh(fc0(RMSNorm(x)))); no biases anywhere
          -> final RMSNorm -> concatenate each 2 x 2 patch neighbourhood (4d)
          -> projector: Linear -> GELU -> Linear to the text width (no biases) -> RMSNorm
Each image gives (h/2) * (w/2) vectors that replace its ``<|media_pad|>`` placeholder in the text.
A video item (1 to 4 frames of one size) runs the same path over all its frames' patches at once:
each frame gets the same grid positions and 2-D RoPE, plus a fixed sin-cos position of its frame
(none for a single frame), attention is joint over every patch of the item, and the frames are
mean-pooled before the 2 x 2 merge, so a video item fills as many tokens as one of its frames.
Module names follow the released checkpoint: ``vision_tower.patch_embed.{proj,pos_emb}``,
``vision_tower.encoder.blocks.{i}.{norm0,wqkv,wo,norm1,mlp.fc0,mlp.fc1}``,
``vision_tower.encoder.final_layernorm``, ``mm_projector.{proj.0,proj.2,post_norm}``.
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

from ..config import ModelConfig
from ..ops import acc_dtype
from .norm import RMSNorm

ROPE_THETA = 10000.0  # base of the 2-D rotary frequencies


MAX_VIDEO_FRAMES = 4  # frames per video item: the released temporal table's length (init_pos_emb_time)


@dataclass
class PreparedImage:
    """One preprocessed image, or one video item of ``frames`` frames: patches [frames*h*w, 3, P, P]
    (frame-major, row-major inside a frame) on an h x w patch grid per frame."""

    patches: torch.Tensor
    grid: tuple[int, int]
    frames: int = 1

    @property
    def num_tokens(self) -> int:
        """Text positions this image fills (after the 2 x 2 merge)."""
        return (self.grid[0] // 2) * (self.grid[1] // 2)


def load_image(image, name: str = "image") -> torch.Tensor:
    """numpy / torch HxWx3 (uint8 0..255 or float 0..1), torch 3xHxW, or a PNG/JPEG path -> float [3, H, W] in 0..1."""
    if isinstance(image, (str, os.PathLike)):
        return _read_image_file(Path(image), name)
    if isinstance(image, np.ndarray):
        # a copy: arrays viewing a PIL image are read-only, which torch.from_numpy warns about
        image = torch.from_numpy(np.array(image, order="C"))
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


def _read_image_file(path: Path, name: str) -> torch.Tensor:
    """A PNG/JPEG file -> float [3, H, W] in 0..1; every way it can fail is a ValueError naming the file."""
    from PIL import Image, UnidentifiedImageError

    if path.is_dir():
        raise ValueError(f"{name}: {str(path)!r} is a directory; pass the path of a PNG/JPEG file in it")
    if not path.is_file():
        raise ValueError(f"{name}: file {str(path)!r} does not exist")
    try:
        with Image.open(path) as im:
            arr = np.asarray(im.convert("RGB"))
    except Image.DecompressionBombError as e:  # Pillow refuses > 2 x MAX_IMAGE_PIXELS before decoding
        raise ValueError(f"{name}: {str(path)!r} is too large to decode safely ({e}); downscale the file, or raise "
                         f"PIL.Image.MAX_IMAGE_PIXELS if you trust it") from None
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{name}: {str(path)!r} is not a readable PNG/JPEG image ({e})") from None
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).float() / 255.0


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


def preprocess_video(frames, cfg: ModelConfig, name: str = "video") -> PreparedImage:
    """1 to MAX_VIDEO_FRAMES frames (arrays, tensors or paths, all of one size) -> one PreparedImage whose
    frames share a patch grid; the tower attends over all of them and pools them into one image's tokens."""
    if isinstance(frames, (str, Path, np.ndarray, torch.Tensor)) or not isinstance(frames, (list, tuple)):
        raise TypeError(f"{name} must be a list of 1 to {MAX_VIDEO_FRAMES} frames (arrays, tensors or image paths), "
                        f"got {type(frames).__name__}")
    if not 1 <= len(frames) <= MAX_VIDEO_FRAMES:
        raise ValueError(f"{name} has {len(frames)} frames; a video item holds 1 to {MAX_VIDEO_FRAMES} (the "
                         f"temporal position table's length): split a longer video into items")
    loaded = [load_image(f, f"{name}[{i}]") for i, f in enumerate(frames)]  # each file read once
    sizes = [tuple(x.shape[1:]) for x in loaded]
    if len(set(sizes)) > 1:
        raise ValueError(f"{name} has frames of different sizes {sorted(set(sizes))} (height, width); every frame "
                         f"of a video must have the same size")
    prepared = [preprocess(x, cfg, name=f"{name}[{i}]") for i, x in enumerate(loaded)]
    return PreparedImage(torch.cat([p.patches for p in prepared]), prepared[0].grid, len(prepared))


def temporal_table(frames: int, d: int) -> torch.Tensor:
    """[frames, d] fixed 1-D sin-cos position of each frame (released: sin half, then cos half, frequencies
    10000^(-i / (d/2))). Added to every patch of a frame of a video item of more than one frame; a single
    frame (an image) gets none, so images are unchanged."""
    omega = 1.0 / 10000 ** (torch.arange(d // 2, dtype=torch.float64) / (d / 2))
    angle = torch.arange(frames, dtype=torch.float64)[:, None] * omega[None]
    return torch.cat([angle.sin(), angle.cos()], dim=1)


def rope_2d(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, H, hd] by each patch's grid position (returned in fp32; fp64 kept).

    Channels (2j, 2j+1) form complex pair j. Pair 2i turns by the patch column and pair 2i + 1 by its
    row, both at frequency theta^(-4i/hd), i < hd/4. This is the released MoonViT layout; a
    row-half/column-half layout is the same function only up to a channel permutation, so real
    ``wqkv`` weights need this one (docs/design.md §8).
    """
    hd = x.shape[-1]
    inv_freq = ROPE_THETA ** (-4 * torch.arange(hd // 4, dtype=torch.float64, device=x.device) / hd)
    by_col, by_row = cols.double().unsqueeze(-1) * inv_freq, rows.double().unsqueeze(-1) * inv_freq  # [N, hd/4]
    angle = torch.stack([by_col, by_row], dim=-1).flatten(-2)  # [N, hd/2]: column, row, column, row, ...
    acc = acc_dtype(x)
    cos, sin = angle.cos().to(acc).unsqueeze(1), angle.sin().to(acc).unsqueeze(1)  # [N, 1, hd/2]
    x = x.to(acc)
    re, im = x[..., 0::2], x[..., 1::2]
    return torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).flatten(-2)  # (re + i im) e^{i angle}


class VisionMLP(nn.Module):
    """``mlp``: fc1(GELU_tanh(fc0(x))), no biases (MoonViT-V2 has ``linear_bias: false``)."""

    def __init__(self, d: int, intermediate: int) -> None:
        super().__init__()
        self.fc0 = nn.Linear(d, intermediate, bias=False)
        self.fc1 = nn.Linear(intermediate, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """``encoder.blocks.{i}``: pre-RMSNorm attention with a fused ``wqkv`` [3 * H * hd, d] (rows: the q
    heads, then k, then v) and ``wo``, then the pre-RMSNorm MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        v = cfg.vision
        self.num_heads, self.head_dim = v.num_heads, v.head_dim
        inner = v.num_heads * v.head_dim
        self.norm0 = RMSNorm(v.hidden_size, cfg.rms_norm_eps)
        self.wqkv = nn.Linear(v.hidden_size, 3 * inner, bias=False)
        self.wo = nn.Linear(inner, v.hidden_size, bias=False)
        self.norm1 = RMSNorm(v.hidden_size, cfg.rms_norm_eps)
        self.mlp = VisionMLP(v.hidden_size, v.intermediate_size)

    def forward(self, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, same_image: torch.Tensor):
        """x [N, d] (all images packed), rows/cols [N] patch coordinates, same_image bool [N, N]."""
        N = x.shape[0]
        q, k, v = self.wqkv(self.norm0(x)).view(N, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rope_2d(q, rows, cols), rope_2d(k, rows, cols)
        v = v.to(q.dtype)  # attention math in fp32 (fp64 kept)
        s = torch.einsum("nhd,mhd->hnm", q, k) * self.head_dim ** -0.5
        s = s.masked_fill(~same_image, float("-inf"))  # full attention inside an image, never across
        o = torch.einsum("hnm,mhd->nhd", torch.softmax(s, dim=-1), v).reshape(N, -1)
        x = x + self.wo(o.to(x.dtype))
        return x + self.mlp(self.norm1(x))


class PositionGrid(nn.Module):
    """``pos_emb``: a learned grid ``weight`` [G, G, d], bilinearly resized to each image's patch grid."""

    def __init__(self, grid: int, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(grid, grid, d))

    def forward(self, h: int, w: int) -> torch.Tensor:
        """-> [h*w, d] in row-major patch order."""
        grid = self.weight.permute(2, 0, 1).unsqueeze(0)  # [1, d, G, G], resized in the model's dtype (as released)
        grid = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=False)
        return grid[0].permute(1, 2, 0).reshape(h * w, -1)


class PatchEmbed(nn.Module):
    """``patch_embed``: conv P x P stride P (``proj``, no bias) plus the position grid (``pos_emb``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        v = cfg.vision
        self.proj = nn.Conv2d(3, v.hidden_size, v.patch_size, stride=v.patch_size, bias=False)
        self.pos_emb = PositionGrid(v.position_grid, v.hidden_size)

    def forward(self, image: PreparedImage) -> torch.Tensor:
        """One item's patches [t*h*w, 3, P, P] -> [t*h*w, d]: the grid's position on every frame, plus
        (t > 1) each frame's temporal position."""
        dtype = self.proj.weight.dtype
        pos = self.pos_emb(*image.grid)  # [h*w, d]
        if image.frames > 1:
            pos = (pos[None] + temporal_table(image.frames, pos.shape[-1]).to(pos)[:, None]).reshape(-1, pos.shape[-1])
        return self.proj(image.patches.to(dtype)).flatten(1) + pos.to(dtype)


class VisionEncoder(nn.Module):
    """``encoder``: the blocks and the final RMSNorm (``final_layernorm``, named as released)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.vision.num_layers))
        self.final_layernorm = RMSNorm(cfg.vision.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, same_image: torch.Tensor):
        for block in self.blocks:
            x = block(x, rows, cols, same_image)
        return self.final_layernorm(x)


class VisionTower(nn.Module):
    """``vision_tower``: patches of several images -> per-image merged features [h/2 * w/2, 4d]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.merge = cfg.vision.merge_size
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = VisionEncoder(cfg)

    def forward(self, images: list[PreparedImage]) -> list[torch.Tensor]:
        xs, rows, cols, owner = [], [], [], []
        for i, im in enumerate(images):
            h, w = im.grid
            xs.append(self.patch_embed(im))
            r, c = torch.meshgrid(torch.arange(h, device=xs[-1].device), torch.arange(w, device=xs[-1].device),
                                  indexing="ij")
            rows.append(r.reshape(-1).repeat(im.frames))  # each frame: the same 2-D RoPE positions
            cols.append(c.reshape(-1).repeat(im.frames))
            owner.append(torch.full((im.frames * h * w,), i, device=xs[-1].device))  # joint over the frames
        rows, cols, owner = torch.cat(rows), torch.cat(cols), torch.cat(owner)
        x = self.encoder(torch.cat(xs), rows, cols, owner.unsqueeze(0) == owner.unsqueeze(1))
        out, start = [], 0
        m = self.merge
        for im in images:
            h, w = im.grid
            n = im.frames * h * w
            feat = x[start: start + n].view(im.frames, h // m, m, w // m, m, -1).mean(0)  # temporal mean-pool
            out.append(feat.permute(0, 2, 1, 3, 4).reshape((h // m) * (w // m), -1))  # 2x2 neighbours, row-major
            start += n
        return out


class MultimodalProjector(nn.Module):
    """``mm_projector``: merged features [n, 4d_vision] -> text embeddings [n, d_text].

    ``proj`` = Linear -> GELU (exact erf) -> Linear, no biases (so the checkpoint names ``proj.0`` and
    ``proj.2``), then the RMSNorm ``post_norm``.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        v = cfg.vision
        self.proj = nn.Sequential(nn.Linear(v.hidden_size * v.merge_size ** 2, v.projector_hidden_size, bias=False),
                                  nn.GELU(), nn.Linear(v.projector_hidden_size, cfg.hidden_size, bias=False))
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(x))
