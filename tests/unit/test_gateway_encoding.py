"""Which Content-Encoding headers the gateway reads a body under: none, identity, or one coding it decodes; 415
naming the ones it does for anything else."""

from __future__ import annotations

import pytest

from node.gateway.openai import ApiError, check_content_encoding

DECODED = ("gzip", "deflate")


@pytest.mark.parametrize("header", [None, "", "identity", "gzip", "GZIP", " deflate ", "identity, gzip"])
def test_accepted(header):
    check_content_encoding(header, DECODED)


@pytest.mark.parametrize("header", ["br", "x-squash", "gzip, gzip", "gzip, deflate", "compress"])
def test_refused_with_415_naming_what_is_decoded(header):
    with pytest.raises(ApiError) as caught:
        check_content_encoding(header, DECODED)
    assert caught.value.status == 415 and caught.value.code == "unsupported_content_encoding"
    assert "gzip, deflate" in caught.value.message and repr(header.strip()) in caught.value.message
