"""``decompress`` refuses what it cannot decode as it stands: a payload another compressor
(or other settings) made, one whose shape or dtype changed since, one whose tensors are
not this compressor's; with a ValueError that names both sides, never garbage."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import gradcomp
from gradcomp.payload import Payload

NAMES = list(gradcomp.COMPRESSORS)
X = torch.arange(4096, dtype=torch.float32).cos().view(64, 64)


def _made(name: str, x: torch.Tensor = X) -> Payload:
    return gradcomp.get_compressor(name).compress(x.clone())


@pytest.mark.parametrize("maker", NAMES)
def test_a_payload_decoded_by_another_compressor_raises_naming_both(maker):
    payload = _made(maker)
    made_by = gradcomp.get_compressor(maker).decoding_key()
    for decoder in NAMES:
        compressor = gradcomp.get_compressor(decoder)
        if decoder == maker:
            assert compressor.decompress(payload).shape == X.shape
            continue
        with pytest.raises(ValueError, match="made by") as raised:
            compressor.decompress(payload)
        assert made_by in str(raised.value) and compressor.decoding_key() in str(raised.value)


@pytest.mark.parametrize(
    ("maker", "decoder"),
    [
        ("int8", "int8:block=128"),
        ("int4:stochastic=true", "int4"),
        ("topk@0.01", "topk@0.02"),
        ("topk", "topk:value_bits=4"),
        ("randk:ratio=0.01", "randk:ratio=0.01,rescale=true"),
        ("powersgd@4", "powersgd@2"),
        ("qsgd", "qsgd:levels=3"),
    ],
)
def test_a_payload_of_other_settings_raises(maker, decoder):
    with pytest.raises(ValueError, match="made by"):
        gradcomp.get_compressor(decoder).decompress(_made(maker))


def test_settings_that_only_change_how_a_payload_is_made_decode():
    # Error feedback and the seed change what is sent, not how it decodes.
    payload = gradcomp.get_compressor("int8").compress(X.clone())
    decoded = gradcomp.get_compressor("int8", feedback=False, seed=7).decompress(payload)
    assert torch.equal(decoded, gradcomp.get_compressor("int8").decompress(payload))


@pytest.mark.parametrize("name", NAMES)
def test_a_payload_whose_shape_or_dtype_changed_raises_naming_both(name):
    compressor = gradcomp.get_compressor(name)
    payload = compressor.compress(X.clone())
    for shape in ((4095,), (8192,), (4096,), (32, 128)):
        changed = dataclasses.replace(payload, shape=torch.Size(shape))
        with pytest.raises(
            ValueError, match=r"made for a tensor of shape \(64, 64\).*not \(" + str(shape[0])
        ):
            compressor.decompress(changed)
    with pytest.raises(ValueError, match="torch.float32, not .* torch.float16"):
        compressor.decompress(dataclasses.replace(payload, dtype=torch.float16))
    # Into an output of the payload's size, whatever its shape, as before.
    out = torch.empty(4096)
    assert compressor.decompress(payload, out=out) is out


@pytest.mark.parametrize("name", NAMES)
def test_a_payload_of_unknown_make_decodes_only_where_its_tensors_fit(name):
    made = _made(name)
    for decoder in NAMES:
        compressor = gradcomp.get_compressor(decoder)
        bare = Payload(dict(made.tensors), made.shape, made.dtype, dict(made.meta))  # no maker
        fits = {n: (t.dtype, t.numel()) for n, t in bare.tensors.items()}
        try:
            layout = compressor.payload_layout(bare.numel, bare.dtype, bare.meta)
            expected = {n: (d, k) for n, d, k in layout}
        except KeyError:
            expected = None
        if fits == expected:
            compressor.decompress(bare)
            continue
        with pytest.raises(ValueError, match="cannot decode this payload of shape"):
            compressor.decompress(bare)
    # Its size changed, where its tensors' sizes follow from it: it no longer fits its maker.
    compressor = gradcomp.get_compressor(name)
    shorter = Payload(dict(made.tensors), torch.Size([4000]), made.dtype, dict(made.meta))
    if compressor.payload_layout(4000, made.dtype, made.meta) != made.layout():
        with pytest.raises(ValueError, match="cannot decode"):
            compressor.decompress(shorter)
