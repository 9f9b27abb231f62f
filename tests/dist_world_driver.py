"""Driver for tests/test_distributed_world.py, run by `python -m torch.distributed.run` (one process per rank).

argv: FAILURE_DIR MODE — MODE "ok" (two collectives), "fail" (rank 1 raises a QuantkitError between them) or
"kill" (rank 1 SIGKILLs itself between them). Writes its outcome to `FAILURE_DIR/../result.<rank>` (the ranks'
stdout interleave) and exits like the CLI: 0, or 2.
"""

import os
import sys
from pathlib import Path

import torch

from quantkit.core.distributed import World
from quantkit.core.errors import QuantkitError

world = World.from_env()
world.start()
failures, mode = Path(sys.argv[1]), sys.argv[2]
try:
    with world.guard(lambda: failures):
        total = world.all_reduce(torch.tensor([float(world.rank + 1)]))
        if world.rank == 1 and mode == "fail":
            raise QuantkitError("shard-2.safetensors: tensor model.layers.3.mlp.experts.1.up_proj.weight is corrupt")
        if world.rank == 1 and mode == "kill":
            os.kill(os.getpid(), 9)
        world.barrier()
        agreed = world.agree(True)
except QuantkitError as exc:
    (failures.parent / f"result.{world.rank}").write_text(str(exc))
    sys.exit(2)
(failures.parent / f"result.{world.rank}").write_text(f"ok sum={total.item():g} agree={agreed}")
world.stop()
