"""Device mesh: named parallel dimensions over the world, validated before any collective.

    mesh = build_mesh(world_size, dp_replicate=1, dp_shard=-1, tp=2)   # dp_shard inferred
    mesh["tp"], mesh["dp_shard"], ...

Dimension order (outer to inner) follows torchtitan: pp, dp_replicate, dp_shard, ep, sp, tp — so
tensor parallelism talks between neighbouring ranks (same host). ep (expert parallelism) is part
of data parallelism: its ranks see different batches, and hold different experts. Only dimensions of size > 1
appear in the mesh. A single process (world size 1) gets no mesh at all (None).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DIM_ORDER = ("pp", "dp_replicate", "dp_shard", "ep", "sp", "tp")


@dataclass(frozen=True)
class MeshSpec:
    """Sizes of each parallel dimension; their product is the world size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    sp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.ep * self.tp * self.sp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: every rank that sees its own batches (ep ranks included)."""
        return self.dp_replicate * self.dp_shard * self.ep

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DIM_ORDER}

    def named_dims(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(names, sizes) of the dimensions larger than 1, outer to inner."""
        dims = [(n, s) for n, s in self.sizes().items() if s > 1]
        return tuple(n for n, _ in dims), tuple(s for _, s in dims)

    def layout(self) -> dict[str, int]:
        """The layout recorded in checkpoint manifests."""
        return {"world_size": self.world_size, "dp": self.dp, "tp": self.tp, "sp": self.sp, "pp": self.pp,
                "ep": self.ep}


def resolve_mesh_spec(world_size: int, dp_replicate: int = 1, dp_shard: int = -1, tp: int = 1, sp: int = 1,
                      pp: int = 1, ep: int = 1) -> MeshSpec:
    """Check the sizes against `world_size` (no communication); `dp_shard=-1` takes what is left.

    Raises ValueError naming the numbers, e.g.
    "dp_replicate=1 × dp_shard=3 × ep=1 × tp=1 × sp=1 × pp=1 = 3 does not equal world size 2".
    """
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    for name, size in (("dp_replicate", dp_replicate), ("ep", ep), ("tp", tp), ("sp", sp), ("pp", pp)):
        if size < 1:
            raise ValueError(f"{name} must be >= 1, got {size}")
    if dp_shard == -1:
        rest = dp_replicate * ep * tp * sp * pp
        if world_size % rest:
            raise ValueError(f"cannot infer dp_shard: dp_replicate={dp_replicate} × ep={ep} × tp={tp} × sp={sp} × pp={pp} "
                             f"= {rest} does not divide world size {world_size}")
        dp_shard = world_size // rest
    elif dp_shard < 1:
        raise ValueError(f"dp_shard must be >= 1 or -1 (infer), got {dp_shard}")
    spec = MeshSpec(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, sp=sp, pp=pp, ep=ep)
    if spec.world_size != world_size:
        raise ValueError(f"dp_replicate={dp_replicate} × dp_shard={dp_shard} × ep={ep} × tp={tp} × sp={sp} × pp={pp} "
                         f"= {spec.world_size} does not equal world size {world_size}")
    return spec


def build_mesh(world_size: int, dp_replicate: int = 1, dp_shard: int = -1, tp: int = 1, sp: int = 1, pp: int = 1,
               ep: int = 1, device_type: str | None = None):
    """A `DeviceMesh` with named dims (only those > 1), or None for a single process.

    Validation happens before any collective, so a wrong layout fails fast and identically on
    every rank. With two or more dims > 1, the flattened "dp" dim (dp_replicate × dp_shard)
    is also created when both are > 1.
    """
    spec = resolve_mesh_spec(world_size, dp_replicate, dp_shard, tp, sp, pp, ep)
    if world_size == 1:
        return None
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs an initialised process group: call tabfm.parallel.launch.launch() first")
    if dist.get_world_size() != world_size:
        raise ValueError(f"build_mesh(world_size={world_size}) but the process group has "
                         f"{dist.get_world_size()} ranks")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    names, sizes = spec.named_dims()
    mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
    if spec.dp_replicate > 1 and spec.dp_shard > 1:
        mesh[("dp_replicate", "dp_shard")]._flatten("dp")
    return mesh


def mesh_rank(mesh, name: str) -> int:
    """This process's coordinate along dimension `name` (0 when the mesh lacks it)."""
    if mesh is None or name not in (mesh.mesh_dim_names or ()):
        return 0
    return mesh.get_local_rank(name)


def sub_mesh(mesh, *names: str):
    """The 1-D mesh spanning the dims `names` (outer to inner) that `mesh` has: None if it has
    none of them, that dim if one, else those dims flattened into one named "a_b..." (its
    process group then holds every rank that differs only in those coordinates)."""
    if mesh is None:
        return None
    present = [n for n in names if n in (mesh.mesh_dim_names or ())]
    if not present:
        return None
    if len(present) == 1:
        return mesh[present[0]]
    return mesh[tuple(present)]._flatten("_".join(present))
