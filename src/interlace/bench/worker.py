"""One rank of a benchmark: `python -m interlace.bench.worker ...`, started by the runner
(inside the rank's network namespace when the link is shaped)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from interlace.bench import get_benchmark
from interlace.bench.base import RankContext
from interlace.comm import Group
from interlace.mesh import DEVICE_ENV


def main() -> None:
    """Initialise gloo over the given interface, run the benchmark's rank function on the CPU
    (`default_device()`), write its result as JSON."""
    p = argparse.ArgumentParser(prog="python -m interlace.bench.worker")
    p.add_argument("name")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ifname", required=True)
    p.add_argument("--rate-bps", type=float, default=None)
    p.add_argument("--options", default="{}")
    p.add_argument("--result", required=True)
    args = p.parse_args()
    os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
    os.environ[DEVICE_ENV] = "cpu"  # gloo carries CPU tensors only
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=900),
    )
    group = Group("world", dist.group.WORLD, args.world, args.rank)
    context = RankContext(group, args.rate_bps, args.ifname, json.loads(args.options))
    result = get_benchmark(args.name).run_rank(context)
    Path(args.result).write_text(json.dumps(result))
    # every rank done with every group before any tears its connections down
    dist.barrier()
    dist.destroy_process_group()
    # leave without interpreter teardown, where leftover communication threads of torch's
    # process groups can abort the process after the work is done (as `testing.run_ranks`)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
