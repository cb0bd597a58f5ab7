"""Tests of the block-scaled float compressors (mxfp8, mxfp4, nvfp4) and their reference ops.

The MX bits follow the OCP Microscaling v1.0 rule (scale ``2 ** (floor(log2(amax)) -
emax)``, elements rounded to nearest even and saturated) and are compared with
torchao's ``to_mx`` in ``ScaleCalculationMode.FLOOR``, the mode that is that rule;
NVFP4's with torchao's ``nvfp4_quantize`` given the same tensor scale. Where torchao
and the spec part (noted at each test) the spec is followed.
"""

from __future__ import annotations

import math

import pytest
import torch

from gradcomp import Context, get_compressor
from gradcomp.ops import reference_mx
from gradcomp.ops.reference import unpack_bits
from gradcomp.payload import buffer_size
from tests.utils import DTYPES, EPS32, assert_conserved, seeded_randn

MX = {"mxfp8": "e4m3", "mxfp4": "e2m1"}
NAMES = ["mxfp8", "mxfp4", "nvfp4"]
SIZES = [1, 31, 32, 1023, 4096, 4097]


def _torchao():
    """torchao's mx_formats, or a skip saying why not."""
    try:
        from torchao.prototype.mx_formats import mx_tensor, nvfp4_tensor
    except Exception as error:  # not installed, or built for another torch
        pytest.skip(f"torchao.prototype.mx_formats does not import: {error!r}")
    return mx_tensor, nvfp4_tensor


def wide_range(numel: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Normal values spread over 2**-40 .. 2**40 block by block, with an all-zero block,
    a block of fp32 subnormals, values at E4M3's and E2M1's saturation and beyond."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=generator)
    powers = torch.randint(-40, 40, (math.ceil(numel / 16),), generator=generator).repeat_interleave(16)
    x = x * torch.exp2(powers[:numel].float())
    planted = [0.0] * 32 + [v * 2.0**-140 for v in range(-16, 16)] + [448.0, -480.0, 6.0, -7.0, 1e30, 3.0]
    x[: min(numel, len(planted))] = torch.tensor(planted[:numel])
    return x.to(dtype)


def padded(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` as fp32 with zeros up to whole blocks: what a tail block is encoded as."""
    return torch.nn.functional.pad(x.float(), (0, (-x.numel()) % block)).view(1, -1)


# ============================================================================= element and scale formats


def test_element_tables_are_the_spec():
    e2m1 = reference_mx.element_values(reference_mx.E2M1, torch.device("cpu"))
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert e2m1.tolist() == magnitudes + [-m for m in magnitudes]
    e4m3 = reference_mx.element_values(reference_mx.E4M3, torch.device("cpu"))
    torch_e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.allclose(e4m3, torch_e4m3, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(e4m3[[0x7F, 0xFF]]).all() and torch.isfinite(e4m3[:0x7F]).all()
    assert e4m3[0x7E] == 448 and e4m3[1] == 2.0**-9


def test_round_to_element_is_nearest_even_and_saturates():
    e2m1 = reference_mx.E2M1
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, 1e9, -0.1, -2.6])
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, -0.0, -3.0]
    assert reference_mx.round_to_element(v, e2m1).tolist() == expected
    # E4M3 against torch's own cast (round to nearest even), saturated at 448.
    x = seeded_randn(100_000, seed=3) * torch.exp2(torch.randint(-14, 10, (100_000,)).float())
    ours = reference_mx.round_to_element(x, reference_mx.E4M3)
    assert torch.equal(ours, x.clamp(-448, 448).to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize(
    ("peak", "e4m3", "e2m1"),
    [
        (1.0, 127 - 8, 127 - 2),
        (1.9999, 127 - 8, 127 - 2),  # the floor of log2
        (448.0, 127, 127 + 6),
        (2.0**-118, 1, 7),
        (2.0**-130, 0, 0),  # below E8M0's smallest scale 2**-127: clamped
        (0.0, 0, 0),  # an all-zero block: any scale decodes zeros; E8M0's smallest, as torchao
        (torch.finfo(torch.float32).max, 254 - 8, 254 - 2),
        (math.inf, 0xFF, 0xFF),  # NaN: the spec's scale of an infinite block is not an E8M0 value
        (math.nan, 0xFF, 0xFF),
    ],
)
def test_e8m0_scale_bits(peak, e4m3, e2m1):
    peak = torch.tensor([peak])
    assert reference_mx.e8m0_scales(peak, reference_mx.E4M3).item() == e4m3
    assert reference_mx.e8m0_scales(peak, reference_mx.E2M1).item() == e2m1


def test_e8m0_values():
    bits = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8)
    values = reference_mx.e8m0_values(bits)
    assert values[:4].tolist() == [2.0**-127, 2.0**-126, 1.0, 2.0**127] and math.isnan(values[4])


# ============================================================================= against torchao


def _unpacked_mx(data: torch.Tensor, element: str) -> torch.Tensor:
    raw = data.contiguous().view(torch.uint8).view(-1)
    return raw if element == "e4m3" else unpack_bits(raw, 4, 2 * raw.numel())


@pytest.mark.parametrize("name", list(MX))
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mx_bits_equal_torchao_floor_mode(name, numel, dtype):
    mx_tensor, _ = _torchao()
    element = MX[name]
    x = wide_range(numel, seed=numel, dtype=dtype)
    codes, scales = reference_mx.mx_quantize(x, element)
    elem_dtype = torch.float8_e4m3fn if element == "e4m3" else torch.float4_e2m1fn_x2
    their_scales, their_data = mx_tensor.to_mx(
        padded(x, 32), elem_dtype, 32, mx_tensor.ScaleCalculationMode.FLOOR
    )
    assert torch.equal(scales, their_scales.view(torch.uint8).view(-1))
    ours = unpack_bits(codes, 8 if element == "e4m3" else 4, numel)
    theirs = _unpacked_mx(their_data, element)[:numel]
    # The spec and torchao part where the scale is E8M0's smallest, 2**-127: torchao
    # divides by 2**-126 there (its scale_fp32 clamped to fp32's smallest normal value)
    # while its scale bits say 2**-127; the elements here are x / 2**-127.
    smallest = (scales == 0).repeat_interleave(32)[:numel]
    assert torch.equal(ours[~smallest], theirs[~smallest])
    spec = reference_mx.round_to_element(x.float()[smallest] * 2.0**127, reference_mx.ELEMENTS[element])
    assert torch.equal(
        reference_mx.decode_elements(codes, reference_mx.ELEMENTS[element], numel)[smallest], spec
    )


def test_mx_smallest_scale_keeps_its_elements():
    # A block of amax 2**-121: scale 2**-127 (E4M3) and elements x * 2**127, not rounded to zero.
    x = torch.full((32,), 2.0**-121)
    codes, scales = reference_mx.mx_quantize(x, "e4m3")
    assert scales.tolist() == [0]
    assert torch.equal(reference_mx.mx_dequantize(codes, scales, "e4m3", 32, 32), x)


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_nvfp4_bits_equal_torchao(numel, dtype):
    _, nvfp4_tensor = _torchao()
    x = wide_range(numel, seed=numel + 1, dtype=dtype)
    codes, scales, tensor_scale = reference_mx.nvfp4_quantize(x)
    amax = x.float().abs().amax()
    assert tensor_scale.item() == max((amax / 2688).item(), reference_mx.SMALLEST_TENSOR_SCALE)
    their_scales, their_data = nvfp4_tensor.nvfp4_quantize(padded(x, 16), 16, tensor_scale)
    assert torch.equal(scales, their_scales.view(torch.uint8).view(-1))
    assert torch.equal(unpack_bits(codes, 4, numel), unpack_bits(their_data.view(-1), 4, numel))


def test_nvfp4_scales_are_e4m3_of_the_block_amax():
    x = seeded_randn(1024, seed=5) * 3
    codes, scales, tensor_scale = reference_mx.nvfp4_quantize(x)
    wanted = (x.view(-1, 16).abs().amax(1) / 6 / tensor_scale).clamp(2.0**-6, 448)
    assert torch.equal(scales, wanted.to(torch.float8_e4m3fn).view(torch.uint8))
    assert scales.max() == 0x7E  # the tensor's largest block uses E4M3's largest value, 448


# ============================================================================= round trip and feedback


def _half_step(v: torch.Tensor, element) -> torch.Tensor:
    """Half the spacing of ``element``'s values around ``|v|``, plus what saturation cuts."""
    _, exponent = torch.frexp(v.abs())
    power = (exponent - 1).clamp(min=element.min_exponent, max=element.largest_power)
    return torch.exp2((power - element.mantissa_bits - 1).float()) + (v.abs() - element.largest).clamp(min=0)


@pytest.mark.parametrize("name", list(MX))
@pytest.mark.parametrize("numel", [1023, 4096])
def test_mx_decoding_is_within_half_a_step(name, numel):
    element = reference_mx.ELEMENTS[MX[name]]
    x = wide_range(numel, seed=7)
    codes, scales = reference_mx.mx_quantize(x, MX[name])
    decoded = reference_mx.mx_dequantize(codes, scales, MX[name], 32, numel)
    scale = reference_mx.e8m0_values(scales).repeat_interleave(32)[:numel]
    assert ((decoded - x).abs() <= _half_step(x / scale, element) * scale).all()


def test_nvfp4_decoding_is_within_half_a_step():
    x = wide_range(4097, seed=8)
    codes, scales, tensor_scale = reference_mx.nvfp4_quantize(x)
    decoded = reference_mx.nvfp4_dequantize(codes, scales, tensor_scale, 16, x.numel())
    block = reference_mx.element_values(reference_mx.E4M3, x.device)[scales.long()] * tensor_scale
    block = block.repeat_interleave(16)[: x.numel()]
    # The elements are x times a rounded reciprocal, decoded times a rounded product: 4 ulp slack.
    bound = _half_step(x / block, reference_mx.E2M1) * block + 4 * EPS32 * (x.abs() + decoded.abs())
    assert ((decoded - x).abs() <= bound).all()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_error_feedback_conserves_over_steps(name, dtype):
    """decoded + new residual == tensor + old residual. MX: exactly (a decoded value is
    within a factor 2 of what it encodes, so their difference is exact in fp32); NVFP4's
    block values are a rounded product: within the fp32 bound."""
    compressor = get_compressor(name)
    assert compressor.needs_feedback
    residual = seeded_randn(1000, seed=4) * 0.25
    for step in range(4):
        x = (seeded_randn(1000, seed=10 + step) * 2.0 ** (4 * step - 8)).to(dtype)  # fp16's range
        y = x.float() + residual
        payload = compressor.compress(x, Context(residual=residual, step=step))
        decoded = compressor.decompress(payload, out=torch.zeros(1000))
        assert_conserved(decoded, residual, y, exact=name in MX)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("planted", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_non_finite_blocks_decode_nan_and_stay_out_of_the_residual(name, planted):
    compressor = get_compressor(name)
    block = 16 if name == "nvfp4" else 32
    x = seeded_randn(100, seed=6)
    x[40] = planted
    residual = torch.zeros(100)
    payload = compressor.compress(x, Context(residual=residual))
    decoded = compressor.decompress(payload)
    hit = 40 // block
    nan = torch.isnan(decoded)
    assert nan[hit * block : (hit + 1) * block].all() and nan.sum() == block
    assert payload.tensors["scales"][hit] == (0x7F if name == "nvfp4" else 0xFF)
    assert torch.isfinite(residual).all() and (residual[hit * block : (hit + 1) * block] == 0).all()


# ============================================================================= wire


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("numel", SIZES)
def test_payload_bytes(name, numel):
    payload = get_compressor(name).compress(seeded_randn(numel, seed=numel))
    expected = {
        "mxfp8": numel + math.ceil(numel / 32),
        "mxfp4": math.ceil(numel / 2) + math.ceil(numel / 32),
        "nvfp4": math.ceil(numel / 2) + math.ceil(numel / 16) + 4,
    }[name]
    assert payload.nbytes == expected
    assert buffer_size(payload.layout()) == -(-expected // 8) * 8


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("numel", [1, 1000, 4097])
@pytest.mark.parametrize("divisor", [1, 3])
def test_decompress_sum_adds_rows_in_order(name, numel, divisor):
    """The sum op over rows (one rank's payload a row) equals decoding each payload
    and adding them in fp32 in row order, then dividing once."""
    compressor = get_compressor(name, feedback=False)
    payloads = [compressor.compress(wide_range(numel, seed=rank) * (rank + 1)) for rank in range(3)]
    width = buffer_size(payloads[0].layout())
    rows = torch.stack([p.to_buffer(size=width + 8) for p in payloads])
    out = torch.empty(numel, dtype=torch.bfloat16)
    compressor.decompress_sum(rows, torch.float32, out, divisor=divisor)
    total = torch.zeros(numel)
    for payload in payloads:
        compressor.decompress(payload, out=total, accumulate=True)
    assert torch.equal(out, (total / divisor).to(torch.bfloat16))


def test_specs_name_the_formats():
    for name in NAMES:
        assert get_compressor(name).name == name
        assert get_compressor(f"{name}:feedback=false").needs_feedback is False
    with pytest.raises(ValueError, match="block"):
        get_compressor("mxfp8:block=64")  # the formats fix their blocks
