"""radixserve.layers.Layer: the base of every layer and model class."""

from __future__ import annotations

import torch
from torch import nn

from radixserve.layers import Layer, RMSNorm
from radixserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Scale(Layer):
    def __init__(self) -> None:
        super().__init__()
        self.factor = nn.Parameter(torch.tensor(2.0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def test_a_layer_call_runs_forward_without_hook_dispatch():
    layer = Scale()
    calls = []
    layer.register_forward_hook(lambda *args: calls.append(args))
    assert torch.equal(layer(torch.ones(3)), torch.full((3,), 2.0))
    assert calls == []  # the call went straight to forward: nn.Module.__call__ would have run the hook
    assert list(layer.state_dict()) == ["factor"]  # otherwise a plain module


def test_the_building_blocks_and_models_are_layers():
    for cls in (RMSNorm, LlamaDecoderLayer, LlamaForCausalLM):
        assert issubclass(cls, Layer)
