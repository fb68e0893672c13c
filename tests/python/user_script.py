"""A kfac_pytorch user's training script, unchanged except for its import.

test_user_script.py runs it with `import kfac` rewritten to `import dkfac as kfac` (and, when a kfac_pytorch
source tree is given, as written), then compares the printed losses.
"""

import logging
import sys
import tempfile

import torch

import kfac
from kfac.enums import ComputeMethod, DistributedStrategy, AssignmentStrategy
from kfac.hyperparams import exp_decay_factor_averaging
from kfac.scheduler import LambdaParamScheduler


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 6, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(6, 8, 3), torch.nn.ReLU(),
        )
        self.head = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 32), torch.nn.ReLU(),
                                        torch.nn.Linear(32, 10))

    def forward(self, x):
        return self.head(self.features(x))


def main():
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    preconditioner = kfac.preconditioner.KFACPreconditioner(
        model,
        factor_update_steps=2,
        inv_update_steps=4,
        damping=0.003,
        factor_decay=exp_decay_factor_averaging(0.95),
        kl_clip=0.001,
        lr=lambda step: lr_scheduler.get_last_lr()[0],
        accumulation_steps=1,
        assignment_strategy=AssignmentStrategy.COMPUTE,
        compute_method=ComputeMethod.EIGEN,
        grad_worker_fraction=DistributedStrategy.COMM_OPT,
        skip_layers=['head.3'],
        loglevel=logging.INFO,
    )
    kfac_scheduler = LambdaParamScheduler(preconditioner, damping_lambda=lambda step: 0.9 if step % 5 == 4 else 1.0)
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(160, 1, 12, 12, generator=generator)
    labels = torch.randint(0, 10, (160,), generator=generator)
    for epoch in range(2):
        model.train()
        for i in range(0, 160, 16):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(images[i:i + 16]), labels[i:i + 16])
            loss.backward()
            preconditioner.step()
            optimizer.step()
            kfac_scheduler.step()
            print(f'loss {loss.item():.6f}')
        lr_scheduler.step()
        model.eval()
        with torch.no_grad():
            print(f'eval {torch.nn.functional.cross_entropy(model(images), labels).item():.6f}')
    with tempfile.TemporaryDirectory() as directory:
        path = f'{directory}/checkpoint.pt'
        torch.save({'model': model.state_dict(), 'preconditioner': preconditioner.state_dict()}, path)
        checkpoint = torch.load(path)
        preconditioner.load_state_dict(checkpoint['preconditioner'])
    print(f'steps {preconditioner.steps}', file=sys.stderr)
    print(f"memory {preconditioner.memory_usage()['total'] > 0}", file=sys.stderr)


if __name__ == '__main__':
    main()
