"""Tests of ErrorFeedback, the residual memory keyed by name."""

from __future__ import annotations

import pytest
import torch

from gradcomp import Context, ErrorFeedback, get_compressor
from tests.utils import seeded_randn


def test_zeros_on_first_use_and_same_tensor_after():
    memory = ErrorFeedback()
    grad = seeded_randn((4, 5), seed=1)
    assert len(memory) == 0 and "w" not in memory and memory.get("w") is None
    residual = memory.residual("w", grad)
    assert residual.shape == (20,) and residual.dtype == torch.float32
    assert torch.equal(residual, torch.zeros(20))
    assert "w" in memory and len(memory) == 1 and memory.keys() == ["w"]
    residual.add_(3.0)
    again = memory.residual("w", seeded_randn(20, seed=2))
    assert again is residual
    assert torch.equal(again, torch.full((20,), 3.0))
    assert memory.get("w") is residual


def test_keys_are_independent():
    memory = ErrorFeedback()
    first = memory.residual(0, torch.zeros(8))
    second = memory.residual(1, torch.zeros(8))
    assert first is not second
    first.fill_(1.0)
    assert torch.equal(second, torch.zeros(8))
    assert sorted(memory.keys()) == [0, 1]


def test_numel_mismatch_raises():
    memory = ErrorFeedback()
    memory.residual("w", torch.zeros(10))
    with pytest.raises(ValueError, match="'w'"):
        memory.residual("w", torch.zeros(11))
    # Same numel in another shape is the same flat residual.
    assert memory.residual("w", torch.zeros(2, 5)).numel() == 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_dtype_policies(dtype):
    grad = seeded_randn(16, seed=3, dtype=dtype)
    assert ErrorFeedback().residual("w", grad).dtype == torch.float32
    assert ErrorFeedback("fp32").residual("w", grad).dtype == torch.float32
    assert ErrorFeedback("grad").residual("w", grad).dtype == dtype
    assert ErrorFeedback("grad").residual("w", grad).device == grad.device


@pytest.mark.parametrize("policy", ["fp16", "float32", "", None, "FP32"])
def test_bad_dtype_policy_raises(policy):
    with pytest.raises(ValueError):
        ErrorFeedback(policy)


@pytest.mark.parametrize("policy", ["fp32", "grad"])
def test_state_dict_round_trip_is_cloned(policy):
    memory = ErrorFeedback(policy)
    memory.residual("a", seeded_randn(6, seed=4, dtype=torch.float16)).copy_(seeded_randn(6, seed=5))
    memory.residual(3, seeded_randn(4, seed=6)).copy_(seeded_randn(4, seed=7))
    state = memory.state_dict()
    assert state["dtype"] == policy
    assert set(state["residuals"]) == {"a", 3}
    for key, saved in state["residuals"].items():
        assert torch.equal(saved, memory.get(key))
        assert saved.dtype == memory.get(key).dtype
        assert saved.data_ptr() != memory.get(key).data_ptr()
    expected = {key: value.clone() for key, value in state["residuals"].items()}

    # Changing the live residuals leaves the saved state alone.
    memory.get("a").zero_()
    assert torch.equal(state["residuals"]["a"], expected["a"])

    restored = ErrorFeedback(policy)
    restored.residual("stale", torch.zeros(2))
    restored.load_state_dict(state)
    assert sorted(map(str, restored.keys())) == ["3", "a"]
    for key, value in expected.items():
        assert torch.equal(restored.get(key), value)
        assert restored.get(key).data_ptr() != state["residuals"][key].data_ptr()
    # Changing the state afterwards leaves the loaded residuals alone.
    state["residuals"][3].fill_(100.0)
    assert torch.equal(restored.get(3), expected[3])
    # The restored residuals are the ones handed out.
    assert restored.residual(3, torch.zeros(4)) is restored.get(3)


def test_load_state_dict_with_other_policy_raises():
    state = ErrorFeedback("grad").state_dict()
    with pytest.raises(ValueError):
        ErrorFeedback("fp32").load_state_dict(state)


def test_set_pop_clear():
    memory = ErrorFeedback()
    memory.set("w", torch.ones(2, 3))
    assert memory.get("w").shape == (6,)
    assert memory.residual("w", torch.zeros(6)) is memory.get("w")
    popped = memory.pop("w")
    assert torch.equal(popped, torch.ones(6))
    assert memory.pop("w") is None and "w" not in memory
    memory.residual("x", torch.zeros(3))
    memory.clear()
    assert len(memory) == 0


def test_residual_is_updated_in_place_by_a_compressor():
    """The residual handed out is the memory itself: compressing through it updates the next step."""
    memory = ErrorFeedback()
    compressor = get_compressor("topk", k=3, exact=True)
    grad = torch.tensor([5.0, -1.0, 0.5, 4.0, -3.0, 0.25])
    residual = memory.residual("w", grad)
    payload = compressor.compress(grad, Context(residual=residual))
    assert torch.equal(memory.get("w"), torch.tensor([0.0, -1.0, 0.5, 0.0, 0.0, 0.25]))
    assert torch.equal(compressor.decompress(payload), torch.tensor([5.0, 0, 0, 4.0, -3.0, 0]))
    compressor.compress(grad, Context(residual=memory.residual("w", grad), step=1))
    # y = [5, -2, 1, 4, -3, 0.5]: 5, 4 and -3 are sent again, the rest accumulates.
    assert torch.equal(memory.get("w"), torch.tensor([0.0, -2.0, 1.0, 0.0, 0.0, 0.5]))
