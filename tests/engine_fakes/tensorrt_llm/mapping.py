"""tensorrt_llm/mapping.py at b35ac1b64368513d215c57d2ed01d62d910df8da (MappingBase, MpiTopology): the
attributes a weight loader reads, the MoE split (moe_tp/moe_ep/moe_cluster sizes and ranks) included."""

import torch


class Mapping:
    def __init__(self, world_size=1, rank=0, gpus_per_node=8, *, cp_size=1, tp_size=1, pp_size=1,
                 moe_cluster_size=-1, moe_tp_size=-1, moe_ep_size=-1, **_):  # fmt: skip
        if tp_size * pp_size * cp_size != world_size:
            raise ValueError("world_size must equal to tp_size * pp_size * cp_size")
        if moe_cluster_size == -1:
            moe_cluster_size = 1
        if moe_tp_size == -1 and moe_ep_size == -1:
            moe_tp_size, moe_ep_size = tp_size // moe_cluster_size, 1
        elif moe_tp_size == -1:
            moe_tp_size = tp_size // (moe_ep_size * moe_cluster_size)
        elif moe_ep_size == -1:
            moe_ep_size = tp_size // (moe_tp_size * moe_cluster_size)
        if moe_tp_size * moe_ep_size * moe_cluster_size != tp_size:
            raise ValueError("tp_size must equal to moe_tp_size * moe_ep_size * moe_cluster_size")
        self.world_size, self.rank, self.gpus_per_node = world_size, rank, gpus_per_node
        self.tp_size, self.pp_size, self.cp_size = tp_size, pp_size, cp_size
        self.moe_tp_size, self.moe_ep_size, self.moe_cluster_size = moe_tp_size, moe_ep_size, moe_cluster_size

    @property
    def tp_rank(self):
        return self.rank % self.tp_size

    @property
    def pp_rank(self):
        return self.rank // (self.tp_size * self.cp_size)

    @property
    def moe_tp_rank(self):
        return self.tp_rank // (self.moe_ep_size * self.moe_cluster_size)

    @property
    def moe_cluster_rank(self):
        return self.tp_rank % self.moe_cluster_size

    @property
    def moe_ep_rank(self):
        return self.tp_rank % self.moe_ep_size

    @property
    def local_rank(self):
        return self.rank % self.gpus_per_node

    @property
    def node_rank(self):
        return self.rank // self.gpus_per_node

    def has_pp(self):
        return self.pp_size > 1

    def pp_layers(self, num_layers):
        return torch.tensor_split(torch.arange(num_layers), self.pp_size)[self.pp_rank].tolist()

    def to_dict(self):
        return {"world_size": self.world_size, "rank": self.rank, "tp_size": self.tp_size, "pp_size": self.pp_size}
