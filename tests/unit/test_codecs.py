"""Wire codecs: exact byte counts, f32 exactness, bounded error for f16/int8, strict decoding."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experts.codecs import Codec, decode, encode, encoded_size, roundtrip
from experts.errors import CodecError


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 9), d=st.integers(1, 200), seed=st.integers(0, 2**16), codec=st.sampled_from(list(Codec)))
def test_sizes_are_exact_and_roundtrip_is_close(n, d, seed, codec):
    """encoded length == encoded_size; f32 is exact, f16/int8 stay within their precision."""
    x = (np.random.default_rng(seed).standard_normal((n, d)) * 3).astype(np.float32)
    data = encode(codec, x)
    assert len(data) == encoded_size(codec, n, d)
    y = decode(codec, data, n, d)
    if codec is Codec.F32:
        assert y.tobytes() == x.tobytes()
    elif codec is Codec.F16:
        np.testing.assert_allclose(y, x, rtol=1e-3, atol=1e-4)
    else:
        bound = np.abs(x).max() / 127 * 0.51 + 1e-6
        assert np.abs(y - x).max() <= bound * 1.01


def test_reference_config_sizes():
    """Hidden 3072: f32 12288 B, f16 6144 B, int8 3264 B per token."""
    assert [encoded_size(c, 1, 3072) for c in Codec] == [12288, 6144, 3264]


def test_wrong_length_and_unknown_codec_are_errors():
    """A payload of the wrong size never decodes; unknown codec names are refused."""
    x = np.ones((2, 40), dtype=np.float32)
    for c in Codec:
        with pytest.raises(CodecError, match="must be"):
            decode(c, encode(c, x)[:-1], 2, 40)
    with pytest.raises(CodecError, match="unknown wire codec"):
        Codec.parse("bf8")


def test_int8_zero_rows_and_f16_overflow_behave():
    """All-zero blocks decode to zeros; int8 rejects a non-finite scale."""
    z = np.zeros((1, 64), dtype=np.float32)
    assert not roundtrip(Codec.INT8, z).any()
    data = bytearray(encode(Codec.INT8, np.ones((1, 32), dtype=np.float32)))
    data[0:2] = np.float16(np.inf).tobytes()
    with pytest.raises(CodecError, match="non-finite"):
        decode(Codec.INT8, bytes(data), 1, 32)


def test_the_wire_codec_byte_is_the_codecs_enum():
    """p2p.wire.messages carries experts.codecs.Codec itself, not a second enum that could drift."""
    from p2p.wire import messages as wire

    assert wire.Codec is Codec
