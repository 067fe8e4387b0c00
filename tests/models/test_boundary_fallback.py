"""Sizing a stage boundary does not depend on the user's factory working under FakeTensorMode.

The issue's case: ``build_layer`` deep-copies a prebuilt module that has buffers, which fails on
fake tensors. The runtime then runs the earlier layers for real, one at a time, and says why in
a one-sentence warning; the boundary it finds is the one training produces. A factory that fails
for real too gets one sentence naming both failures."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from torch import nn

from chameleon_elastic.runtime import PipelineModel, PipelineRuntimeError
from chameleon_elastic.runtime.execution.executor import boundary_spec


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("scale", torch.full((6,), 2.0))

    def forward(self, x):
        return {"h": self.lin(x * self.scale), "ids": torch.zeros(x.shape[:-1],
                                                                  dtype=torch.int64)}


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        return self.lin(x["h"])


PREBUILT = (Scaled(), Head())


def _deep_copying(i: int) -> nn.Module:
    return copy.deepcopy(PREBUILT[i])


def _always_broken(i: int) -> nn.Module:
    raise OSError("weights.bin is missing")


def _model(factory) -> PipelineModel:
    return PipelineModel(num_layers=2, build_layer=factory,
                         loss=lambda out, y: nn.functional.cross_entropy(out, y),
                         make_optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                         sample=lambda i: (torch.ones(6) * i, torch.tensor(i % 3)))


def test_a_factory_that_fails_on_fake_tensors_is_sized_for_real_with_a_warning():
    from chameleon_elastic.torch_compat import fake_tensor_mode

    with pytest.raises(RuntimeError), fake_tensor_mode():   # the obstacle, as torch shows it
        _deep_copying(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = boundary_spec(_model(_deep_copying), 1, micro_batch_size=4)
    assert [(s.shape, s.dtype, s.requires_grad) for s in spec.leaves] == [
        ((4, 6), torch.float32, True), ((4,), torch.int64, False)]
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "FakeTensorMode" in messages[0] and "\n" not in messages[0]


def test_bf16_boundary_sized_for_real_keeps_autocast_dtypes():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        spec = boundary_spec(_model(_deep_copying), 1, micro_batch_size=2, precision="bf16")
    assert spec.leaves[0].dtype == torch.bfloat16


def test_a_factory_that_fails_for_real_too_is_one_sentence():
    with pytest.raises(PipelineRuntimeError) as err:
        boundary_spec(_model(_always_broken), 1, micro_batch_size=2)
    message = str(err.value)
    assert "fake tensors" in message and "weights.bin is missing" in message
    assert "\n" not in message
