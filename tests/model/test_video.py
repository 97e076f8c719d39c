"""The released vision path for video: 1 to 4 frames per item, joint attention over all their patches with a
fixed sin-cos temporal position per frame, temporal mean-pooling before the projector (model/vision.py)."""

import math

import numpy as np
import pytest
import torch

import minidsa
from minidsa.model.vision import MAX_VIDEO_FRAMES, preprocess, preprocess_video, temporal_table


@pytest.fixture(scope="module")
def model():
    return minidsa.load("default", progress=False)


def frame(seed: int, size=(56, 56)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def test_temporal_table_is_the_released_sin_cos():
    d, t = 8, 3
    table = temporal_table(t, d)
    for f in range(t):
        for i in range(d // 2):
            w = 1.0 / 10000 ** (i / (d / 2))
            assert math.isclose(table[f, i], math.sin(f * w), abs_tol=1e-15)          # sin half first
            assert math.isclose(table[f, d // 2 + i], math.cos(f * w), abs_tol=1e-15)  # then cos


def test_a_one_frame_video_is_exactly_an_image(model):
    im = frame(0)
    as_video = model.encode_images([preprocess_video([im], model.config)])[0]
    as_image = model.encode_images([preprocess(im, model.config)])[0]
    assert torch.equal(as_video, as_image)   # no temporal position for a single frame, pooling over one


def test_frames_attend_jointly_and_are_mean_pooled(model):
    tower = model.vision_tower
    a, b = frame(1), frame(2)
    video = preprocess_video([a, b], model.config)
    got = tower([video])[0]
    assert got.shape[0] == preprocess(a, model.config).num_tokens == video.num_tokens
    # rebuilt: embed each frame with its temporal position, one joint encoder pass, mean over frames
    x = tower.patch_embed(video)
    h, w = video.grid
    r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    rows, cols = r.reshape(-1).repeat(2), c.reshape(-1).repeat(2)
    enc = tower.encoder(x, rows, cols, torch.ones(2 * h * w, 2 * h * w, dtype=torch.bool))
    pooled = enc.view(2, h // 2, 2, w // 2, 2, -1).mean(0).permute(0, 2, 1, 3, 4).reshape(h * w // 4, -1)
    torch.testing.assert_close(got, pooled, atol=0, rtol=0)
    alone = [tower([preprocess(f, model.config)])[0] for f in (a, b)]
    assert not torch.allclose(got, (alone[0] + alone[1]) / 2, atol=1e-4)   # not two separate images averaged


def test_generate_with_a_video(model):
    cache = model.new_cache()
    text = minidsa.generate("Q: colour and shape?\nA: ", model, videos=[[frame(3), frame(4)]], max_new_tokens=4,
                            temperature=0, cache=cache)
    assert isinstance(text, str)
    assert cache.num_free_blocks == cache.layout.num_blocks


@pytest.mark.parametrize("frames,error,match", [
    ([], ValueError, "has 0 frames; a video item holds 1 to 4"),
    ([frame(0)] * (MAX_VIDEO_FRAMES + 1), ValueError, "has 5 frames"),
    ([frame(0), frame(1, (70, 56))], ValueError, "frames of different sizes"),
    (frame(0), TypeError, "must be a list of 1 to 4 frames"),
])
def test_bad_videos_are_refused_before_anything_is_taken(model, frames, error, match):
    cache = model.new_cache()
    with pytest.raises(error, match=match):
        minidsa.generate("hi", model, videos=[frames], cache=cache)
    assert cache.num_free_blocks == cache.layout.num_blocks and not cache.sequences()


def test_video_markers_must_match_the_videos(model):
    """One VIDEO_MARKER per video; a marker with no video, or one too few, is refused before anything is taken."""
    from minidsa.tokenizer import VIDEO_MARKER
    cache = model.new_cache()
    with pytest.raises(ValueError, match=r"1 <\|media_pad\|> placeholder\(s\) but 0 image\(s\) and 0 video\(s\)"):
        minidsa.generate(f"{VIDEO_MARKER}\nQ: colour and shape?\nA: ", model, cache=cache)
    with pytest.raises(ValueError, match=r"2 <\|media_pad\|> placeholder\(s\) but 0 image\(s\) and 1 video\(s\)"):
        minidsa.generate(VIDEO_MARKER * 2, model, videos=[[frame(0)]], cache=cache)
    assert cache.num_free_blocks == cache.layout.num_blocks and not cache.sequences()
    kw = dict(max_new_tokens=3, temperature=0, stop_at_eos=False, cache=cache)
    marked = minidsa.generate(f"{VIDEO_MARKER}hi", model, videos=[[frame(3), frame(4)]], **kw)
    assert marked == minidsa.generate("hi", model, videos=[[frame(3), frame(4)]], **kw)  # the default place
