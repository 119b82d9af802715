"""Mesh demonstration: each rank prints its mesh coordinates, dp rank and group members.

Run as ``credit-parallel mesh-demo --nproc 4`` (launches 4 CPU ranks with torchrun).
"""

from __future__ import annotations

import argparse
import sys

import torch.distributed as dist

from ..layout.config import parse_domain_option
from ..layout.device import device_for_process_group
from ..layout.launch import init_distributed_from_env
from ..layout.mesh import build_device_mesh, data_parallel_coords


def describe_rank(block: dict) -> str:
    mesh, subs = build_device_mesh(block, device=device_for_process_group().type)
    rank = dist.get_rank()
    dp_rank, dp_size = data_parallel_coords({"trainer": {"parallelism": block}})
    coords = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate())) if mesh is not None else {}
    groups = {name: dist.get_process_group_ranks(sub.get_group()) for name, sub in subs.items()}
    return f"rank {rank}: mesh coords {coords}, dp rank {dp_rank}/{dp_size}, groups {groups}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m credit_parallel.tools.mesh_demo")
    ap.add_argument("--data", default="fsdp2")
    ap.add_argument("--tensor", default="2")
    ap.add_argument("--domain", default="1", help="D (latitude only) or PxQ (lat x lon)")
    a = ap.parse_args(argv)
    init_distributed_from_env(timeout_s=60)
    block = {"data": a.data, "tensor": a.tensor, "domain": parse_domain_option(a.domain)}
    line = describe_rank(block)
    # print in rank order so the output reads as a table
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, line)
    if dist.get_rank() == 0:
        print(f"mesh for {block} on {dist.get_world_size()} ranks:")
        for text in lines:
            print("  " + text)
        sys.stdout.flush()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
