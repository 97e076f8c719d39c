"""Vision tower and multimodal generate (docs/design.md §8)."""

import math
import warnings

import numpy as np
import pytest
import torch

import minidsa
from minidsa.model.vision import preprocess, rope_2d, target_size
from minidsa.tokenizer import IMAGE_MARKER, ByteTokenizer

TOK = ByteTokenizer()


def rgb(h, w, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.mark.parametrize("hw", [(28, 28), (60, 90), (100, 50), (14, 300), (224, 224), (1000, 700)])
def test_preprocess_sizes_and_aspect_ratios(tiny_model, hw):
    cfg = tiny_model.config
    im = preprocess(rgb(*hw), cfg)
    h, w = im.grid
    assert h % 2 == 0 and w % 2 == 0 and h * w <= cfg.vision.max_patches
    assert im.patches.shape == (h * w, 3, 14, 14)
    assert im.num_tokens == (h // 2) * (w // 2)
    assert -1 <= float(im.patches.min()) and float(im.patches.max()) <= 1  # mean = std = 0.5
    if hw[0] * hw[1] <= cfg.vision.max_patches * 14 * 14 / 2:  # no budget pressure: sides round to 28
        assert (h * 14, w * 14) == (max(28, round(hw[0] / 28) * 28), max(28, round(hw[1] / 28) * 28))
    ratio_in, ratio_out = hw[1] / hw[0], w / h
    assert abs(np.log(ratio_out / ratio_in)) < np.log(3)  # aspect ratio roughly kept


def test_normalisation_and_patch_order(tiny_model):
    img = np.zeros((28, 56, 3), dtype=np.uint8)
    img[:14, 14:28] = 255  # the patch at row 0, column 1 is white
    im = preprocess(img, tiny_model.config)
    assert im.grid == (2, 4)
    assert torch.all(im.patches[1] == 1.0) and torch.all(im.patches[0] == -1.0) and torch.all(im.patches[4] == -1.0)


def test_budget_scales_down():
    h, w = target_size(2000, 1000, 14, 2, 256)
    assert (h // 14) * (w // 14) <= 256 and h % 28 == 0 and w % 28 == 0 and h > w


def test_rope_2d_is_relative():
    q, k = torch.randn(1, 2, 16, dtype=torch.float64), torch.randn(1, 2, 16, dtype=torch.float64)

    def score(r1, c1, r2, c2):
        a = rope_2d(q, torch.tensor([r1]), torch.tensor([c1]))
        b = rope_2d(k, torch.tensor([r2]), torch.tensor([c2]))
        return (a * b).sum(-1)
    torch.testing.assert_close(score(3, 5, 1, 2), score(10, 9, 8, 6), atol=1e-12, rtol=0)
    assert not torch.allclose(score(3, 5, 1, 2), score(3, 5, 2, 1))  # rows and columns are distinct


def test_rope_2d_interleaved_pairs_worked_by_hand():
    # head_dim 8: complex pairs (0,1), (2,3), (4,5), (6,7); frequencies theta^(-4i/8) for i = 0, 1, i.e. 1 and
    # 1e4^-0.5 = 0.01. Pair 0 turns by the column, pair 1 by the row (frequency 1); pairs 2 and 3 likewise at 0.01.
    # A unit real part in every pair (x = 1 + 0i) therefore comes out as (cos a, sin a) with the angles below;
    # a unit imaginary part (x = 0 + 1i) as (-sin a, cos a). Row 3, column 5.
    angles = [5.0, 3.0, 0.05, 0.03]
    real = torch.tensor([[[1.0, 0, 1, 0, 1, 0, 1, 0]]], dtype=torch.float64)
    imag = torch.tensor([[[0.0, 1, 0, 1, 0, 1, 0, 1]]], dtype=torch.float64)
    want_real = [v for a in angles for v in (math.cos(a), math.sin(a))]
    want_imag = [v for a in angles for v in (-math.sin(a), math.cos(a))]
    rows, cols = torch.tensor([3]), torch.tensor([5])
    # 1e-15: fp64 evaluation of cos/sin of the same angles; only the last bits may differ
    torch.testing.assert_close(rope_2d(real, rows, cols)[0, 0], torch.tensor(want_real, dtype=torch.float64),
                               atol=1e-15, rtol=0)
    torch.testing.assert_close(rope_2d(imag, rows, cols)[0, 0], torch.tensor(want_imag, dtype=torch.float64),
                               atol=1e-15, rtol=0)


def test_attention_never_crosses_images(tiny_model):
    a, b = rgb(56, 84, 1), rgb(84, 56, 2)
    b2 = b.copy()
    b2[10:40] = 255 - b2[10:40]
    with torch.no_grad():
        fa, fb = tiny_model.encode_images(tiny_model.prepare_images([a, b]))
        fa2, fb2 = tiny_model.encode_images(tiny_model.prepare_images([a, b2]))
        alone, = tiny_model.encode_images(tiny_model.prepare_images([a]))
    assert torch.equal(fa, fa2) and not torch.allclose(fb, fb2)
    torch.testing.assert_close(fa, alone, atol=1e-6, rtol=0)  # packing with another image changes nothing


def test_two_images_and_image_only_prompt(tiny_model):
    imgs = [rgb(56, 56, 3), rgb(28, 84, 4)]
    prompt = f"compare {IMAGE_MARKER} with {IMAGE_MARKER} please"
    text = minidsa.generate(prompt, tiny_model, images=imgs, max_new_tokens=6, temperature=0,
                            trace=True, stop_at_eos=False)
    tr = text.trace
    n = [preprocess(im, tiny_model.config).num_tokens for im in imgs]
    assert len(tr.image_positions) == sum(n) == 4 + 3
    ids = tr.token_ids[: tr.prompt_len]
    first = ids.index(TOK.media_pad_id)
    assert ids[first: first + n[0]] == [TOK.media_pad_id] * n[0] and ids[first + n[0]] == TOK.media_end_id
    mask = tr.image_keys(tiny_model.config.mla_layers[0])
    assert mask.shape == (len(tr.token_ids), tiny_model.config.indexer.topk) and mask.any()
    only = minidsa.generate("", tiny_model, images=[imgs[0]], max_new_tokens=3, temperature=0,
                            trace=True, stop_at_eos=False)
    tr2 = only.trace
    assert tr2.token_ids[0] == TOK.bos_id and tr2.token_ids[1] == TOK.media_begin_id
    assert tr2.prompt_len == 1 + len(TOK.encode(IMAGE_MARKER, add_bos=False, allow_special=True)) - 1 + n[0]
    default = minidsa.generate("x", tiny_model, images=[imgs[0]], max_new_tokens=3, temperature=0, stop_at_eos=False)
    explicit = minidsa.generate(IMAGE_MARKER + "x", tiny_model, images=[imgs[0]], max_new_tokens=3, temperature=0,
                                stop_at_eos=False)
    assert default == explicit


def test_multimodal_prefill_decode_equals_full_forward():
    model = minidsa.MiniDSA(minidsa.load_config("tiny").replace(dtype="float64"))
    imgs = model.prepare_images([rgb(56, 84, 5)])
    with torch.no_grad():
        feats = model.encode_images(imgs)
        prompt = TOK.encode("see " + IMAGE_MARKER + " now", allow_special=True)
        k = prompt.index(TOK.media_pad_id)
        prompt = prompt[:k] + [TOK.media_pad_id] * imgs[0].num_tokens + prompt[k + 1:]
        new = [104, 105, 106, 107, 108]
        full_ids = torch.tensor([prompt + new])
        full = model(inputs_embeds=model.embed(full_ids, feats))
        cache = model.new_cache()
        sid = cache.add_sequence()
        outs = [model(inputs_embeds=model.embed(torch.tensor([prompt]), feats), cache=cache, seq_ids=[sid])]
        outs += [model(torch.tensor([[t]]), cache=cache, seq_ids=[sid]) for t in new]
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-11, rtol=0)  # fp64: rounding only


def test_image_files(tiny_model, tmp_path):
    from PIL import Image
    arr = rgb(40, 70, 6)
    Image.fromarray(arr).save(tmp_path / "a.png")
    p_arr = preprocess(arr, tiny_model.config).patches
    assert torch.equal(preprocess(str(tmp_path / "a.png"), tiny_model.config).patches, p_arr)
    smooth = np.stack(list(np.meshgrid(np.linspace(0, 255, 70), np.linspace(0, 255, 40))) + [np.full((40, 70), 99.0)],
                      -1).astype(np.uint8)
    Image.fromarray(smooth).save(tmp_path / "b.jpg", quality=95)
    jpg = preprocess(tmp_path / "b.jpg", tiny_model.config).patches
    ref = preprocess(smooth, tiny_model.config).patches
    assert jpg.shape == ref.shape and (jpg - ref).abs().mean() < 0.02  # lossy, but the same picture
    t = torch.from_numpy(arr)
    assert torch.equal(preprocess(t, tiny_model.config).patches, p_arr)
    assert torch.equal(preprocess(t.permute(2, 0, 1).float() / 255, tiny_model.config).patches, p_arr)
    # An array viewing a PIL image is read-only: accepted as is, without torch's non-writable warning.
    frozen = np.asarray(Image.fromarray(arr))
    assert not frozen.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(preprocess(frozen, tiny_model.config).patches, p_arr)


BAD_IMAGES = [
    (lambda p: np.zeros((30, 30, 4), dtype=np.uint8), ValueError, r"RGB image .*alpha"),
    (lambda p: np.zeros((30, 30), dtype=np.uint8), ValueError, "RGB image"),
    (lambda p: np.zeros((1, 1, 3), dtype=np.uint8), ValueError, r"1 x 1 pixels; it must be at least 14 x 14"),
    (lambda p: np.full((30, 30, 3), np.nan, dtype=np.float32), ValueError, "NaN"),
    (lambda p: np.full((30, 30, 3), 7.0, dtype=np.float32), ValueError, r"\[0, 1\]"),
    (lambda p: (p / "notes.png").write_text("not an image") and str(p / "notes.png"), ValueError,
     "not a readable PNG/JPEG"),
    (lambda p: str(p / "missing.png"), ValueError, "does not exist"),
    (lambda p: {"pixels": 1}, TypeError, "numpy array"),
]


@pytest.mark.parametrize("make, exc, msg", BAD_IMAGES)
def test_bad_images_raise_clearly_and_leave_model_usable(tiny_model, tmp_path, make, exc, msg):
    cache = tiny_model.default_cache()
    good = minidsa.generate("ok", tiny_model, images=[rgb(28, 28)], max_new_tokens=3, temperature=0, stop_at_eos=False)
    with pytest.raises(exc, match=msg):
        minidsa.generate("ok", tiny_model, images=[make(tmp_path)], max_new_tokens=3)
    assert cache.sequences() == [] and cache.num_free_blocks == cache.layout.num_blocks
    again = minidsa.generate("ok", tiny_model, images=[rgb(28, 28)], max_new_tokens=3, temperature=0,
                             stop_at_eos=False)
    assert again == good


def test_placeholder_count_mismatch(tiny_model):
    img = rgb(28, 28)
    with pytest.raises(ValueError, match=r"1 <\|media_pad\|> placeholder\(s\) but 2 image\(s\)"):
        minidsa.generate(IMAGE_MARKER + "two?", tiny_model, images=[img, img], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"2 <\|media_pad\|> placeholder\(s\) but 1 image"):
        minidsa.generate(IMAGE_MARKER * 2, tiny_model, images=[img], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"1 <\|media_pad\|> placeholder\(s\) but 0 image"):
        minidsa.generate(IMAGE_MARKER, tiny_model, images=[], max_new_tokens=2)
    with pytest.raises(TypeError, match="list of images"):
        minidsa.generate("x", tiny_model, images=img, max_new_tokens=2)


NO_IMAGE = r"1 <\|media_pad\|> placeholder\(s\) but 0 image\(s\) and 0 video\(s\).*pass one image per IMAGE_MARKER"


@pytest.mark.parametrize("prompt, where", [(f"{IMAGE_MARKER}\nQ: colour and shape?\nA: ", "prompt"),
                                           (["plain", f"see {IMAGE_MARKER}"], r"prompt\[1\]")])
def test_a_marker_without_an_image_is_refused(tiny_model, prompt, where):
    """Read as its literal bytes, the marker got a confident answer about an image nobody sent."""
    cache = tiny_model.default_cache()
    with pytest.raises(ValueError, match=f"^{where} has {NO_IMAGE}"):
        minidsa.generate(prompt, tiny_model, max_new_tokens=2)
    assert cache.sequences() == [] and cache.num_free_blocks == cache.layout.num_blocks
    engine = minidsa.Engine(tiny_model)
    with pytest.raises(ValueError, match=NO_IMAGE):
        engine.add_request(f"see {IMAGE_MARKER}", minidsa.SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests()
    # other special-token strings in a text-only prompt stay literal text, as before
    assert isinstance(minidsa.generate("<|media_begin|>x<|eos|>", tiny_model, max_new_tokens=2), str)


def test_a_marker_of_the_other_kind_is_refused(tiny_model):
    """Placeholders take the images first, then the videos: a VIDEO_MARKER must not receive an image."""
    from minidsa.tokenizer import VIDEO_MARKER
    img = rgb(28, 28)
    with pytest.raises(ValueError, match="placeholder 0 is written as a video marker but receives images\\[0\\]"):
        minidsa.generate(f"{VIDEO_MARKER} what?", tiny_model, images=[img], max_new_tokens=2)
    with pytest.raises(ValueError, match="placeholder 0 is written as a video marker but receives images\\[0\\]"):
        minidsa.generate(f"{VIDEO_MARKER}{IMAGE_MARKER}", tiny_model, images=[img], videos=[[img]], max_new_tokens=2)
    both = minidsa.generate(f"{IMAGE_MARKER}{VIDEO_MARKER}", tiny_model, images=[img], videos=[[img]],
                            max_new_tokens=2, temperature=0, stop_at_eos=False)
    default = minidsa.generate("", tiny_model, images=[img], videos=[[img]], max_new_tokens=2, temperature=0,
                               stop_at_eos=False)
    assert both == default  # no marker: the images, then the videos, before the text


def test_batch_with_images(tiny_model):
    imgs = [[rgb(28, 56, 7)], []]
    texts = minidsa.generate(["look", "text only"], tiny_model, images=imgs, max_new_tokens=4, temperature=0,
                             stop_at_eos=False)
    alone = minidsa.generate("look", tiny_model, images=imgs[0], max_new_tokens=4, temperature=0, stop_at_eos=False)
    assert texts[0] == alone
    assert texts[1] == minidsa.generate("text only", tiny_model, max_new_tokens=4, temperature=0, stop_at_eos=False)


def test_checkpoint_carries_the_vision_tower(tmp_path):
    model = minidsa.load("tiny")
    model.save_pretrained(tmp_path)
    names = set(__import__("json").loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"])
    # the released MoonViT-V2 / projector names (docs/design.md §8); no biases anywhere
    assert {"vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.pos_emb.weight",
            "vision_tower.encoder.blocks.1.norm0.weight", "vision_tower.encoder.blocks.1.wqkv.weight",
            "vision_tower.encoder.blocks.1.wo.weight", "vision_tower.encoder.blocks.1.norm1.weight",
            "vision_tower.encoder.blocks.1.mlp.fc0.weight", "vision_tower.encoder.blocks.1.mlp.fc1.weight",
            "vision_tower.encoder.final_layernorm.weight", "mm_projector.proj.0.weight", "mm_projector.proj.2.weight",
            "mm_projector.post_norm.weight"} <= names
    assert not [n for n in names if n.startswith(("vision_tower.", "mm_projector.")) and n.endswith(".bias")]
    loaded = minidsa.load(tmp_path)
    kw = dict(images=[rgb(56, 56, 8)], max_new_tokens=4, temperature=0, stop_at_eos=False)
    assert minidsa.generate("x", loaded, **kw) == minidsa.generate("x", model, **kw)


def test_the_position_grid_is_resized_in_the_models_dtype():
    import torch.nn.functional as F

    from minidsa.model.vision import PositionGrid
    grid = PositionGrid(4, 3).double()
    with torch.no_grad():
        grid.weight.copy_(torch.rand(4, 4, 3, dtype=torch.float64))
    out = grid(3, 5)
    ref = F.interpolate(grid.weight.permute(2, 0, 1)[None], size=(3, 5), mode="bilinear", align_corners=False)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref[0].permute(1, 2, 0).reshape(15, 3), atol=0, rtol=0)   # fp64 throughout
