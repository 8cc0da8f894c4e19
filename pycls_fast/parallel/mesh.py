"""The (pp, dp, tp) layout of the ranks and its device mesh.

NUM_GPUS = PP x DP x TP ranks, ordered as torchtitan orders them: tensor-parallel
ranks are neighbours (rank = (pp_i x DP + dp_i) x TP + tp_i), so that on a node of 8
GPUs a TP group of up to 8 stays on NVLink; pipeline stages are the outermost and
cross nodes, where only activations travel. Data-parallel ranks (DDP or FSDP) are the
ranks of one `dp` coordinate row: they read different images; the TP and PP ranks of
one data-parallel rank read the same batch.
"""

import dataclasses

from yacs.config import CfgNode


@dataclasses.dataclass(frozen=True)
class Layout:
    """How many ranks each kind of parallelism spans."""

    pp: int = 1
    dp: int = 1
    tp: int = 1

    @staticmethod
    def from_cfg(cfg: CfgNode, world_size: int | None = None) -> "Layout":
        """The layout of `world_size` ranks (default NUM_GPUS) for cfg.PARALLEL."""
        world = world_size or cfg.NUM_GPUS
        tp, pp = cfg.PARALLEL.TP, cfg.PARALLEL.PP
        return Layout(pp=pp, dp=world // (tp * pp), tp=tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def model_parallel(self) -> bool:
        """Whether TP or PP is on (a device mesh is then built)."""
        return self.tp > 1 or self.pp > 1

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) coordinates of `rank`."""
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp

    def data_rank(self, rank: int) -> int:
        """Which data-parallel shard of the batches `rank` reads."""
        return self.coords(rank)[1]

    def describe(self) -> str:
        parts = [f"{n} {getattr(self, n.lower())}" for n in ("PP", "DP", "TP")]
        return " x ".join(parts)


def build_mesh(layout: Layout, device_type: str):
    """The DeviceMesh of `layout` with dims ('pp', 'dp', 'tp'); every rank calls it
    (it creates the process groups of each dimension)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(
        device_type,
        (layout.pp, layout.dp, layout.tp),
        mesh_dim_names=("pp", "dp", "tp"),
    )
