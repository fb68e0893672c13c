"""Models for 28x28 single-channel images (Fashion-MNIST), shared by the example and bench/python_step.py.

``resnet(depth, width)``: a torchvision-style ResNet (``BasicBlock``; module names ``conv1``, ``bn1``,
``layer1``..``layer3``, ``downsample``, ``avgpool``, ``fc`` as in ``torchvision.models.resnet``) adapted
to small inputs: a 3x3 stride-1 stem without max-pooling, three stages of widths ``width``, ``2*width``,
``4*width`` (the last two halve the resolution: 28 -> 14 -> 7), ``(depth - 2) / 6`` blocks per stage,
1x1-conv + BN projection shortcuts where the shape changes. ``depth`` 8, 14, 20, ... (6n + 2).

``cnn()``: the "cnn" of dkfac's C++ tools (tools/models/models.cpp): Conv2d(1, 32, 3, pad 1) - ReLU -
MaxPool2 - Conv2d(32, 32, 3, pad 1) - ReLU - MaxPool2 - Flatten - Linear(1568, 256) - ReLU - Linear(256, 10).
"""

from __future__ import annotations

import torch
from torch import nn

MAX_CHANNELS = 256


def conv3x3(inplanes: int, planes: int, stride: int = 1) -> nn.Conv2d:
    """3x3 convolution with padding 1 and no bias (a BatchNorm follows)."""
    return nn.Conv2d(inplanes, planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(inplanes: int, planes: int, stride: int = 1) -> nn.Conv2d:
    """1x1 convolution without bias, for projection shortcuts."""
    return nn.Conv2d(inplanes, planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus the (projected) input, then ReLU."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ResNet of BasicBlocks for small single-channel images (see the module docstring)."""

    def __init__(self, blocks_per_stage: list[int], width: int = 16, in_channels: int = 1,
                 num_classes: int = 10, zero_init_residual: bool = False) -> None:
        super().__init__()
        widths = [width << i for i in range(len(blocks_per_stage))]
        if widths[-1] > MAX_CHANNELS:
            raise ValueError(f'widths {widths} exceed {MAX_CHANNELS} channels; use width <= '
                             f'{MAX_CHANNELS >> (len(widths) - 1)}')
        self.inplanes = width
        self.conv1 = conv3x3(in_channels, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        for i, (planes, blocks) in enumerate(zip(widths, blocks_per_stage)):
            setattr(self, f'layer{i + 1}', self._make_layer(planes, blocks, stride=1 if i == 0 else 2))
        self.num_stages = len(widths)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[-1], num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode='fan_out', nonlinearity='relu')
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, BasicBlock):
                    nn.init.zeros_(m.bn2.weight)

    def _make_layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes, stride), nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        for i in range(self.num_stages):
            x = getattr(self, f'layer{i + 1}')(x)
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def resnet(depth: int = 14, width: int = 16, num_classes: int = 10, zero_init_residual: bool = False) -> ResNet:
    """ResNet-``depth`` (6n + 2: 8, 14, 20, ...) with stage widths ``width``, 2x, 4x."""
    if depth < 8 or (depth - 2) % 6 != 0:
        raise ValueError(f'depth must be 6n + 2 with n >= 1 (8, 14, 20, 26, ...), got {depth}')
    n = (depth - 2) // 6
    return ResNet([n, n, n], width=width, num_classes=num_classes, zero_init_residual=zero_init_residual)


def cnn(num_classes: int = 10) -> nn.Sequential:
    """The C++ tools' "cnn" for 1x28x28 inputs."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 256), nn.ReLU(), nn.Linear(256, num_classes),
    )


def get_model(name: str, depth: int = 14, width: int = 16) -> nn.Module:
    """'resnet' (with depth, width) or 'cnn'."""
    if name == 'resnet':
        return resnet(depth, width)
    if name == 'cnn':
        return cnn()
    raise ValueError(f"model must be 'resnet' or 'cnn', got {name!r}")
