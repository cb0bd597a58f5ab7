"""A misspelt option at every integration's entry point: one message, the entry point
named, the nearest name among the hook's options and the compressor's, and both lists."""

from __future__ import annotations

import pytest
import torch


def _callback(name: str, **options):
    module = pytest.importorskip(name.rpartition(".")[0])
    return getattr(module, name.rpartition(".")[2])("int8", **options)


def _fabric(**options):
    lightning = pytest.importorskip("gradcomp.integrations.lightning")
    return lightning.register_fabric(torch.nn.Linear(4, 4), "int8", **options)


def _accelerate(**options):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    from gradcomp.integrations.accelerate import register

    accelerator = accelerate.Accelerator(cpu=True)
    try:
        return register(accelerator, accelerator.prepare(torch.nn.Linear(4, 4)), "int8", **options)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


ENTRY_POINTS = {
    "GradcompCallback": lambda **o: _callback("gradcomp.integrations.transformers.GradcompCallback", **o),
    "GradientCompression": lambda **o: _callback("gradcomp.integrations.lightning.GradientCompression", **o),
    "register_fabric": _fabric,
    "gradcomp.integrations.accelerate.register": _accelerate,
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize(("misspelt", "nearest"), [("warmup_step", "warmup_steps"), ("blok", "block")])
def test_a_misspelt_option_names_the_nearest_of_the_hooks_and_the_compressors(entry, misspelt, nearest):
    with pytest.raises(ValueError) as raised:
        ENTRY_POINTS[entry](**{misspelt: 3})
    message = str(raised.value)
    assert entry in message and f"did you mean '{nearest}'" in message, message
    assert all(name in message for name in ("warmup_steps", "min_numel", "block", "stochastic")), message


@pytest.mark.parametrize(
    "entry", ["GradcompCallback", "GradientCompression", "gradcomp.integrations.accelerate.register"]
)
def test_missing_residuals_is_refused_unless_raise_or_zero(entry):
    with pytest.raises(ValueError, match="missing_residuals must be 'raise'.*or 'zero'"):
        ENTRY_POINTS[entry](missing_residuals="skip")
