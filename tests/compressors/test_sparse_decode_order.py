"""Top-K's and random-K's decode of several ranks' payloads adds them in rank order,
whatever order a GPU would run the adds in (played on CPU: :mod:`tests.scheduling`),
on every backend: every rank that decodes the same rows gets the same bits."""

from __future__ import annotations

import pytest
import torch

import gradcomp
from gradcomp import ops
from gradcomp.compressors import Context
from gradcomp.payload import buffer_size, row_views
from tests.scheduling import differing, overlapping_input, overlapping_rows, perturbed, rank_order_sum
from tests.utils import backend_device, backend_params

WORLDS = (3, 4, 5, 6, 7)
NUMEL, K = 20_000, 3_000
BACKENDS = [pytest.param("torch", id="torch"), *backend_params()]


@pytest.fixture
def on(backend, monkeypatch):
    """The backend every op runs on, and its device."""
    monkeypatch.setenv("GRADCOMP_BACKEND", backend)
    return torch.device("cpu") if backend == "torch" else backend_device(backend)


def _rows(compressor, fields: dict[str, torch.Tensor], meta: dict[str, int]) -> torch.Tensor:
    """The gathered rows of payloads whose tensors are ``fields`` (one payload a row)."""
    layout = compressor.payload_layout(NUMEL, torch.float32, meta)
    rows = torch.zeros(next(iter(fields.values())).shape[0], buffer_size(layout), dtype=torch.uint8)
    for name, view in row_views(rows, layout).items():
        view.copy_(fields[name])
    return rows


def _decodes(compressor, rows, meta, divisor: int, backend: str, device, seed: int):
    """The rows decoded by both of the collectives' decodes, each under its own schedule."""
    rows = rows.to(device)
    results = []
    for decode in ("decompress_sum", "decode_rows"):
        out = torch.full((NUMEL,), 5.0, device=device)
        with perturbed(backend, seed):
            if decode == "decompress_sum":
                compressor.decompress_sum(rows, torch.float32, out, meta=meta, divisor=divisor)
            else:
                compressor.decode_rows(rows, out, meta, divisor)
        results.append((decode, out.cpu()))
        seed += 1
    return results


@pytest.mark.parametrize("divisor", [1, "world"])
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_rows_are_summed_in_rank_order(on, backend, world, divisor):
    divisor = world if divisor == "world" else divisor
    compressor = gradcomp.get_compressor("topk", k=K)
    indices, values = overlapping_rows(world, K, NUMEL, seed=world + 20)
    rows = _rows(compressor, {"indices": indices.to(torch.int32), "values": values}, {"k": K})
    expected = rank_order_sum(indices, values / divisor, torch.zeros(NUMEL))
    assert differing(expected, rank_order_sum(indices.flip(0), values.flip(0) / divisor, torch.zeros(NUMEL)))
    for decode, got in _decodes(compressor, rows, {"k": K}, divisor, backend, on, seed=world):
        assert differing(expected, got) == 0, f"{decode}: {differing(expected, got)} elements differ"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_randk_rows_are_summed_in_rank_order(on, backend, world):
    """Random-K's rows share all their indices: every index is chosen by every rank."""
    compressor, meta = gradcomp.get_compressor("randk", k=K), {"k": K, "seed": 31}
    indices = ops.randk_indices(NUMEL, K, 31).expand(world, K)
    _, values = overlapping_rows(world, K, NUMEL, seed=world + 30)
    rows = _rows(compressor, {"values": values}, meta)
    expected = rank_order_sum(indices, values, torch.zeros(NUMEL))
    assert differing(expected, rank_order_sum(indices, values.flip(0), torch.zeros(NUMEL)))
    for decode, got in _decodes(compressor, rows, meta, 1, backend, on, seed=world):
        assert differing(expected, got) == 0, f"{decode}: {differing(expected, got)} elements differ"


@pytest.mark.parametrize(
    "spec", ["topk:ratio=0.08", "topk:ratio=0.08,value_bits=4", "topk:ratio=0.08,exact=true"]
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_compressed_payloads_decode_to_the_rank_order_sum_of_their_decodings(on, backend, spec):
    """Payloads as ranks send them, their picks mostly the same positions, decoded
    together: every rank's own decoding, added in rank order, bit for bit."""
    world = 5
    compressor = gradcomp.get_compressor(spec)
    payloads = [
        compressor.compress(overlapping_input(rank, NUMEL, seed=41).to(on), Context(step=0, key=3, rank=rank))
        for rank in range(world)
    ]
    expected = torch.zeros(NUMEL, device=on)
    for payload in payloads:
        expected += compressor.decompress(payload, divisor=world)
    backwards = torch.zeros(NUMEL, device=on)
    for payload in reversed(payloads):
        backwards += compressor.decompress(payload, divisor=world)
    assert differing(expected, backwards) > 10
    width = max(buffer_size(payload.layout()) for payload in payloads)
    rows = torch.stack([payload.to_buffer(width) for payload in payloads])
    for decode, got in _decodes(compressor, rows, payloads[0].meta, world, backend, on, seed=world):
        assert differing(expected, got) == 0, f"{decode}: {differing(expected, got)} elements differ"
