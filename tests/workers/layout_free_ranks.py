"""Two ranks writing and reading a layout-free state with neox_hf's DCP reader alone (torch only, no model: a few
seconds of start-up), each rank writing what it saw to FOLDER/rank{R}.txt, a line per read:

    torchrun --standalone --nproc_per_node 2 tests/workers/layout_free_ranks.py FOLDER

First each rank writes its half of a tensor and both read it back into zeroed targets (`equal True`); then
rank 1's file is cut to half its length and both read again: each rank reads alone, so only rank 1 meets the damage,
and both must still report it (`rank R: refused <message>`) rather than one failing and the other going on.
"""

import os
import sys
from pathlib import Path


def main(folder: Path) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from neox_hf.checkpoint.layout_free import FOLDER, load_layout_free, save_layout_free
    from neox_hf.errors import CheckpointError

    dist.init_process_group("gloo")
    rank, mesh = dist.get_rank(), init_device_mesh("cpu", (2,))
    full = torch.arange(256 * 64, dtype=torch.float32).reshape(256, 64)

    def targets():
        return {"model/w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]),
                "exp_avg/w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)])}

    save_layout_free({"model/w": distribute_tensor(full, mesh, [Shard(0)]),
                      "exp_avg/w": distribute_tensor(-full, mesh, [Shard(0)])}, folder)
    read = targets()
    load_layout_free(read, folder)
    equal = torch.equal(read["model/w"].full_tensor(), full) and torch.equal(read["exp_avg/w"].full_tensor(), -full)
    said = [f"equal {equal}"]
    dist.barrier()
    if rank == 0:
        damaged = folder / FOLDER / "__1_0.distcp"
        damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    dist.barrier()
    try:
        load_layout_free(targets(), folder)
        said.append("read")
    except CheckpointError as err:
        said.append(f"refused {err}")
    (folder / f"rank{rank}.txt").write_text("\n".join(said))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(Path(sys.argv[1])))
