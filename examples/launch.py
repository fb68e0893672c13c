"""Start N local workers of a Python script under torch's elastic agent (what ``torchrun --standalone`` does).

    python3 examples/launch.py --nproc-per-node 2 examples/fashion_mnist_resnet.py --epochs 1

Each worker runs ``<this python> -u SCRIPT ARGS...`` with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set, so the script's ``init_process_group(init_method='env://')`` joins the
group. It calls ``torch.distributed.launcher.api.elastic_launch`` directly with the settings ``torchrun
--standalone`` would use on one node: a rendezvous on this host (static by default, c10d with --rdzv-backend
c10d), no restarts, a short monitor interval, so programs (and tests) can drive the agent's API; ``torchrun
--standalone --nproc-per-node=N SCRIPT ARGS`` does the same from the command line.

With --no-python (torchrun's flag of the same name) the workers run SCRIPT itself, an executable such as
``dkfac train``: ``examples/launch.py --no-python --nproc-per-node 2 dkfac train --model cnn``.
--max-restarts N lets the agent restart failed workers up to N times (TORCHELASTIC_RESTART_COUNT counts
them; ``dkfac train`` resumes from its --checkpoint-dir on a restart).

Like torchrun, it sets OMP_NUM_THREADS for the workers when it is not set (to cores / N here, torchrun
uses 1). Exit status: 0 when every worker succeeded, 1 otherwise (the failing worker's error is printed).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import uuid


def free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--nproc-per-node', '--nproc_per_node', type=int, default=2, help='local workers')
    parser.add_argument('--rdzv-backend', '--rdzv_backend', choices=['static', 'c10d'], default='static',
                        help='rendezvous: static (the agent\'s TCP store) or c10d (as torchrun --standalone)')
    parser.add_argument('--master-port', '--master_port', type=int, default=0,
                        help='rendezvous port on 127.0.0.1 (0: a free one)')
    parser.add_argument('--monitor-interval', type=float, default=0.5,
                        help='seconds between the agent\'s checks of the workers')
    parser.add_argument('--log-dir', default=None,
                        help='directory for the agent\'s per-worker error files (default: a temporary one)')
    parser.add_argument('--timeout', type=int, default=300, help='rendezvous timeout in seconds')
    parser.add_argument('--max-restarts', '--max_restarts', type=int, default=0,
                        help='how often the agent restarts failed workers before giving up')
    parser.add_argument('--no-python', '--no_python', action='store_true',
                        help='run SCRIPT as an executable instead of with this Python')
    parser.add_argument('script', help='the Python script (or with --no-python the program) each worker runs')
    parser.add_argument('script_args', nargs=argparse.REMAINDER, help='arguments for the script')
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing import Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if 'OMP_NUM_THREADS' not in os.environ:
        os.environ['OMP_NUM_THREADS'] = str(max(1, (os.cpu_count() or 1) // args.nproc_per_node))
    port = args.master_port or free_port()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=args.nproc_per_node,
        run_id=f'launch-{uuid.uuid4().hex[:12]}',
        rdzv_backend=args.rdzv_backend,
        rdzv_endpoint=f'127.0.0.1:{port}',
        rdzv_configs={'rank': 0, 'timeout': args.timeout} if args.rdzv_backend == 'static' else {'timeout': args.timeout},
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        start_method='spawn',
        logs_specs=DefaultLogsSpecs(log_dir=args.log_dir, redirects=Std.NONE, tee=Std.NONE),
    )
    try:
        if args.no_python:
            elastic_launch(config, args.script)(*args.script_args)
        else:
            elastic_launch(config, sys.executable)('-u', args.script, *args.script_args)
    except ChildFailedError as error:
        print(error.format_msg(), file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
