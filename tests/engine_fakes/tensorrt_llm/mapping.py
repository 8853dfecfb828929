"""tensorrt_llm/mapping.py at b35ac1b64368513d215c57d2ed01d62d910df8da (MappingBase, MpiTopology): the
attributes a weight loader reads."""

import torch


class Mapping:
    def __init__(self, world_size=1, rank=0, gpus_per_node=8, *, cp_size=1, tp_size=1, pp_size=1, **_):
        if tp_size * pp_size * cp_size != world_size:
            raise ValueError("world_size must equal to tp_size * pp_size * cp_size")
        self.world_size, self.rank, self.gpus_per_node = world_size, rank, gpus_per_node
        self.tp_size, self.pp_size, self.cp_size = tp_size, pp_size, cp_size

    @property
    def tp_rank(self):
        return self.rank % self.tp_size

    @property
    def pp_rank(self):
        return self.rank // (self.tp_size * self.cp_size)

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
