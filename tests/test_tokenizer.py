import pytest

from minidsa.tokenizer import SPECIAL_TOKENS, ByteTokenizer

TEXTS = ["", "hello", "héllo wörld", "日本語のテキスト", "emoji 🎉🧪 mix", "tab\tnew\nline\x00nul",
         "<|media_pad|> is literal text here", "\U0010ffff edge"]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id
    assert ids[1:] == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_ids_and_specials():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256 + 7
    assert [tok.special_to_id[t] for t in SPECIAL_TOKENS] == list(range(256, 263))
    ids = tok.encode("a<|media_begin|><|media_pad|><|media_end|>b", add_bos=False, allow_special=True)
    assert ids == [97, tok.media_begin_id, tok.media_pad_id, tok.media_end_id, 98]
    assert tok.decode(ids, skip_special=False) == "a<|media_begin|><|media_pad|><|media_end|>b"
    assert tok.decode(ids) == "ab"


def test_invalid_bytes_decode_to_replacement():
    tok = ByteTokenizer()
    assert tok.decode([0xFF, 104]) == "\ufffdh"


def test_stream_decoder_holds_back_partial_characters():
    tok = ByteTokenizer()
    dec = tok.stream_decoder()
    pieces = [dec.push(b) for b in "é🎉".encode()]
    assert pieces == ["", "é", "", "", "", "🎉"]


def test_bad_input():
    tok = ByteTokenizer()
    with pytest.raises(TypeError, match="str"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="surrogate"):
        tok.encode("\ud800")
