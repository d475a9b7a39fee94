"""FAKE ``apex.normalization`` modules (tests only): Apex's constructor signatures; forward in
plain PyTorch, which is also what Apex itself runs for CPU tensors."""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from torch import nn

import apex

ACCELKIT_FAKE = True


def _shape(normalized_shape):
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(normalized_shape)


class FusedLayerNorm(nn.Module):
    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False):
        super().__init__()
        self.normalized_shape = torch.Size(_shape(normalized_shape))
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape))
            self.bias = nn.Parameter(torch.zeros(self.normalized_shape))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        apex.record(
            "FusedLayerNorm",
            kwargs=dict(
                normalized_shape=tuple(self.normalized_shape),
                eps=eps,
                elementwise_affine=elementwise_affine,
                memory_efficient=memory_efficient,
            ),
        )

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class FusedRMSNorm(nn.Module):
    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False):
        super().__init__()
        self.normalized_shape = torch.Size(_shape(normalized_shape))
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape))
        else:
            self.register_parameter("weight", None)
        apex.record(
            "FusedRMSNorm",
            kwargs=dict(
                normalized_shape=tuple(self.normalized_shape),
                eps=eps,
                elementwise_affine=elementwise_affine,
                memory_efficient=memory_efficient,
            ),
        )

    def forward(self, x):
        dims = tuple(range(-len(self.normalized_shape), 0))
        y = x * torch.rsqrt(x.float().pow(2).mean(dims, keepdim=True) + self.eps).to(x.dtype)
        return y if self.weight is None else y * self.weight
