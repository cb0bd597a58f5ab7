"""A NaN gradient on one rank: CompressedAdam skips the step on every rank, DiLoCo raises on
every rank; neither leaves a non-finite or divergent model, nor state the step changed."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import gradcomp
from gradcomp.optim import CompressedAdam
from tests.test_optim import HYPER, backward, make_model
from tests.utils import run_ranks, same_on_all_ranks

STEPS = 7


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _same(mine: list[torch.Tensor], theirs: list[torch.Tensor]) -> bool:
    """Whether two lists of tensors are equal bit for bit, tensor by tensor."""
    return len(mine) == len(theirs) and all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


def _adam_state(model: torch.nn.Module, optimizer: CompressedAdam) -> list[torch.Tensor]:
    """The parameters, moments and residuals, in a fixed order."""
    moments = [optimizer.state[p][k] for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")]
    residuals = [optimizer.feedback.get(k) for k in sorted(optimizer.feedback.keys(), key=repr)]
    return [_flat(model), *moments, *residuals]


def _adam_run(rank: int, bad_step: int | None, skip_batch: bool) -> tuple[CompressedAdam, torch.nn.Module]:
    """STEPS batches; at ``bad_step`` rank 1's gradient holds a NaN (or, ``skip_batch``, that
    batch is left out altogether on every rank)."""
    model = make_model()
    # A compressed warm-up and compressed updates: residuals in both phases, the warm-up's
    # left over into the momentum at the first frozen step (4).
    optimizer = CompressedAdam(
        model.parameters(), compressor="sign", gradient_compressor="int8", warmup_steps=3, **HYPER
    )
    for step in range(STEPS):
        if step == bad_step and skip_batch:
            continue
        model.zero_grad()
        backward(model, rank, step)
        if step == bad_step and rank == 1:
            next(model.parameters()).grad[0, 0] = float("nan")
        if step != bad_step:
            optimizer.step()
            continue
        before = [t.clone() for t in _adam_state(model, optimizer)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.step()
        assert any("skipped on every rank" in str(w.message) for w in caught), [str(w) for w in caught]
        assert _same(_adam_state(model, optimizer), before)
        assert torch.isfinite(_flat(model)).all() and same_on_all_ranks(_flat(model))
        assert optimizer.steps_done == step and optimizer.skipped_steps == 1
    return optimizer, model


def _adam_skips(rank: int, world_size: int) -> None:
    for bad_step in (1, 3, 5):  # in the warm-up, the first frozen step, a later one
        optimizer, model = _adam_run(rank, bad_step, skip_batch=False)
        reference, reference_model = _adam_run(rank, bad_step, skip_batch=True)
        assert optimizer.steps_done == reference.steps_done == STEPS - 1
        assert _same(_adam_state(model, optimizer), _adam_state(reference_model, reference)), bad_step


@pytest.mark.slow
def test_compressed_adam_skips_a_non_finite_step_on_every_rank():
    run_ranks(_adam_skips, 2)


# ----------------------------------------------------------------------------- DiLoCo

SYNC_EVERY = 3


def _diloco(rank: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    inner = torch.optim.SGD(model.parameters(), lr=0.05)  # no state of its own to repair
    return model, inner, gradcomp.DiLoCo(model, inner, sync_every=SYNC_EVERY, compressor="int4")


def _inner_step(model, inner, outer, step: int, rank: int, poison: bool = False) -> None:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(16, 8, generator=generator), torch.randn(16, 2, generator=generator)
    torch.nn.functional.mse_loss(model(x), y).backward()
    if poison:
        next(model.parameters()).grad[0, 0] = float("nan")
    inner.step()
    inner.zero_grad()
    outer.step()


def _outer_state(outer) -> list[torch.Tensor]:
    residuals = [outer.feedback.get(k) for k in sorted(outer.feedback.keys(), key=repr)]
    return [*outer.anchor, *outer.momentum, *residuals, torch.tensor(outer.outer_steps)]


def _diloco_raises(rank: int, world_size: int) -> None:
    model, inner, outer = _diloco(rank)
    for step in range(SYNC_EVERY):  # a first synchronisation
        _inner_step(model, inner, outer, step, rank)
    saved = copy.deepcopy(outer.state_dict())
    before = [t.clone() for t in _outer_state(outer)]
    bad = SYNC_EVERY + 1
    for step in range(SYNC_EVERY, 2 * SYNC_EVERY - 1):
        _inner_step(model, inner, outer, step, rank, poison=rank == 1 and step == bad)
    with pytest.raises(FloatingPointError, match="holds NaN or Inf"):
        _inner_step(model, inner, outer, 2 * SYNC_EVERY - 1, rank)
    weights = _flat(model)
    assert torch.isfinite(weights).all() and same_on_all_ranks(weights)
    assert torch.equal(weights, torch.cat([a.reshape(-1) for a in outer.anchor]))
    assert _same(_outer_state(outer), before)
    # Going on equals a run that left that period out: its state loaded at the same step.
    model_b, inner_b, outer_b = _diloco(rank)
    outer_b.load_state_dict({**saved, "local_step": outer.local_step})
    for step in range(2 * SYNC_EVERY, 4 * SYNC_EVERY):
        _inner_step(model, inner, outer, step, rank)
        _inner_step(model_b, inner_b, outer_b, step, rank)
    assert torch.equal(_flat(model), _flat(model_b))
    assert _same(_outer_state(outer), _outer_state(outer_b))


@pytest.mark.slow
def test_diloco_raises_on_every_rank_with_its_state_as_before():
    run_ranks(_diloco_raises, 2)
