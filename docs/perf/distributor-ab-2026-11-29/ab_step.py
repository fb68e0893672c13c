"""One side of a paired A/B: time the K-FAC training step of a small MLP and a small CNN (1 thread); prints JSON."""
import json, statistics, sys, time
import torch
import dkfac
torch.set_num_threads(1)

def run(kind, steps=400, warm=50):
    torch.manual_seed(0)
    if kind == 'mlp':
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    else:
        model = torch.nn.Sequential(torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                    torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                    torch.nn.Flatten(), torch.nn.Linear(32 * 7 * 7, 10))
        x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pre = dkfac.KFACPreconditioner(model, factor_update_steps=10, inv_update_steps=100, lr=0.01)
    times, kfac = [], []
    for s in range(steps + warm):
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        t1 = time.perf_counter()
        pre.step()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if s >= warm:
            times.append(t3 - t0)
            kfac.append(t2 - t1)
    return {'step_ms': 1e3 * statistics.median(times), 'kfac_ms': 1e3 * statistics.median(kfac),
            'kfac_p90_ms': 1e3 * sorted(kfac)[int(0.9 * len(kfac))]}

print(json.dumps({k: run(k) for k in ('mlp', 'cnn')}))
