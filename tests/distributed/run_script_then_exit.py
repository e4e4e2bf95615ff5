"""Run a script as `__main__` under `accelerate launch`, then end the way `common.finish` does.

    accelerate launch ... tests/distributed/run_script_then_exit.py SCRIPT [ARGS...]

For scripts that end on their own, as classic TRL's examples do (no `end_training`): after the script's last
line, a barrier, then `os._exit(0)`, which skips interpreter shutdown, where torch's gloo threads abort some
finished 2-process CPU runs ("terminate called without an active exception": 3 of 16 runs of
`examples/classic/ppo.py` here, machine load 4-6).
"""

import os
import runpy
import sys

import torch.distributed as dist


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]  # the script sees its own name and arguments
    runpy.run_path(script, run_name="__main__")
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
