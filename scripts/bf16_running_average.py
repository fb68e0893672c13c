#!/usr/bin/env python3
"""How far a bfloat16 running average F = 0.95 F + 0.05 F_batch drifts from the float32 one.

Random ReLU features of the cnn's second conv layer (289 wide), 94 updates = two epochs of factor updates
every 10 steps at batch 128 (docs/PRECISION.md quotes the output).
"""

import torch

torch.manual_seed(0)
n = 289
exact = torch.eye(n)
rounded = torch.eye(n).bfloat16()
batch_error = 0.0
for _ in range(94):
    x = torch.relu(torch.randn(512, n)) / 16
    batch = x.t() @ x / 512
    batch_error = float((batch.bfloat16().float() - batch).norm() / batch.norm())
    exact = 0.95 * exact + 0.05 * batch
    rounded = 0.95 * rounded + 0.05 * batch.bfloat16()
print(f'one batch factor rounded to bfloat16: relative error {batch_error:.4f}')
print(f'bfloat16 running average after 94 updates: relative error {float((rounded.float() - exact).norm() / exact.norm()):.4f}')
