"""The vLLM adapter's dry run (streamer_client.integrations._dry_run, _tensor_use, _vllm_shards) without vLLM: the recorder
follows stand-ins through the narrows of weight loaders written here the way vLLM's parallel layers
narrow, writes nothing, and says which part of each checkpoint tensor a rank keeps; the plan hands
pre-sliced tensors only to parameters whose check run wrote them as the full load does.

The loaders below exist for these tests only (the package ships none); tests/test_vllm.py runs
the same module against vLLM's own layers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from streamer_client.integrations._dry_run import record
from streamer_client.integrations._tensor_use import Landing, Recording, TensorSpec, TensorUse, Use
from streamer_client.integrations._vllm_shards import Handoff, plan_from, plan_shards

F32 = torch.float32


def spec(*shape: int, dtype=F32) -> TensorSpec:
    return TensorSpec(dtype, tuple(shape))


def frozen(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in params.items()}


def assert_unwritten(before: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> None:
    for name, p in params.items():
        assert torch.equal(p, before[name]), f"the dry run wrote {name}"


class Rank(nn.Module):
    """One tensor-parallel rank of a small transformer block, loaded as vLLM's layers load it:
    column-parallel (dim 0) and row-parallel (dim 1) narrows at ``rank × shard``, a fused qkv
    parameter fed by q/k/v tensors by shard id (KV heads replicated when fewer than ranks) or by
    one tensor fused on disk, a vocabulary split by padded shards (the last shard clipped, its
    padding rows zeroed), norms copied whole, rotary and other ranks' experts ignored.

    ``presliced`` on a parameter makes its loader skip its narrow, like vLLM's
    ``is_sharded_weight``; only the qkv parameter's fused-on-disk path ignores it, as vLLM's does.
    """

    HIDDEN, HEAD, HEADS, VOCAB, PADDED = 8, 2, 4, 13, 16

    def __init__(self, rank: int, tp: int, kv_heads: int = 2, experts: tuple[int, ...] = (0, 1)):
        super().__init__()
        self.rank, self.tp, self.kv_heads, self.experts = rank, tp, kv_heads, experts
        h, hd = self.HIDDEN, self.HEAD
        self.q_size = self.HEADS // tp * hd
        self.kv_replicas = max(1, tp // kv_heads)
        self.kv_size = max(1, kv_heads // tp) * hd
        g = torch.Generator().manual_seed(rank)

        def param(*shape):
            return nn.Parameter(torch.randn(*shape, generator=g), requires_grad=False)

        self.qkv = param(self.q_size + 2 * self.kv_size, h)
        self.o = param(h, self.HEADS * hd // tp)
        self.up = param(16 // tp, h)
        self.norm = param(h)
        self.embed = param(self.PADDED // tp, h)
        self.expert = nn.ParameterList([param(4, h) for _ in experts])

    def fused_shape(self) -> tuple[int, int]:
        return (self.HEADS * self.HEAD + 2 * self.kv_heads * self.HEAD, self.HIDDEN)

    def checkpoint(self) -> dict[str, TensorSpec]:
        h, hd = self.HIDDEN, self.HEAD
        return {
            "embed.weight": spec(self.VOCAB, h),
            "q.weight": spec(self.HEADS * hd, h),
            "k.weight": spec(self.kv_heads * hd, h),
            "v.weight": spec(self.kv_heads * hd, h),
            "o.weight": spec(h, self.HEADS * hd),
            "up.weight": spec(16, h),
            "norm.weight": spec(h),
            "rotary.inv_freq": spec(hd // 2),
            **{f"experts.{e}.weight": spec(4, h) for e in range(4)},
        }

    def load_weights(self, weights):
        loaded = set()
        for name, w in weights:
            if name == "rotary.inv_freq":
                continue
            if name.startswith("experts."):
                e = int(name.split(".")[1])
                if e not in self.experts:
                    continue  # another expert-parallel rank's expert
                self.expert[self.experts.index(e)].data.copy_(w)
            elif name in ("q.weight", "k.weight", "v.weight"):
                self._qkv_shard(w, name[0])
            elif name == "qkv.weight":  # fused on disk: narrowed at full offsets, then by shard id
                offsets = (
                    ("q", 0, self.HEADS * self.HEAD),
                    ("k", self.HEADS * self.HEAD, self.kv_heads * self.HEAD),
                    ("v", (self.HEADS + self.kv_heads) * self.HEAD, self.kv_heads * self.HEAD),
                )
                for shard_id, offset, size in offsets:
                    self._qkv_shard(w.narrow(0, offset, size), shard_id)
            elif name == "o.weight":
                self._sharded(self.o, w, dim=1)
            elif name == "up.weight":
                self._sharded(self.up, w, dim=0)
            elif name == "norm.weight":
                self.norm.data.copy_(w)
            elif name == "embed.weight":
                self._vocab(w)
            else:
                raise ValueError(f"no parameter for {name}")
            loaded.add(name)
        return loaded

    def _sharded(self, param, w, dim):
        size = param.shape[dim]
        if not getattr(param, "presliced", False):
            w = w.narrow(dim, self.rank * size, size)
        param.data.copy_(w)

    def _qkv_shard(self, w, shard_id):
        offset, size = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size), "v": (self.q_size + self.kv_size, self.kv_size)}[
            shard_id
        ]
        part = self.qkv.data.narrow(0, offset, size)
        shard_rank = self.rank if shard_id == "q" else self.rank // self.kv_replicas
        if not getattr(self.qkv, "presliced", False):
            w = w.narrow(0, shard_rank * size, size)
        assert part.shape == w.shape, (part.shape, w.shape)
        part.copy_(w)

    def _vocab(self, w):
        per_rank = self.PADDED // self.tp
        start = min(self.rank * per_rank, self.VOCAB)
        end = min(start + per_rank, self.VOCAB)
        if not getattr(self.embed, "presliced", False):
            assert w.shape[0] == self.VOCAB
            w = w.narrow(0, start, end - start)
        self.embed[: w.shape[0]].data.copy_(w)
        self.embed[w.shape[0] :].data.fill_(0)


def targets_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def presliced_flag(param) -> Handoff:
    return Handoff("presliced", "presliced", True)


def cut(full: torch.Tensor, pieces) -> torch.Tensor:
    """What the slices API yields for ``pieces``: the pieces, concatenated along their dim."""
    return torch.cat([full.narrow(dim, start, stop - start) for dim, start, stop in pieces], dim=pieces[0][0])


def full_tensors(tensors: dict[str, TensorSpec], seed: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(s.shape, generator=g, dtype=s.dtype) for name, s in tensors.items()}


# --- the recorder -------------------------------------------------------------------------------


def test_each_tensor_is_recorded_as_the_part_its_rank_keeps_and_nothing_is_written():
    model = Rank(rank=1, tp=2, kv_heads=1, experts=(2, 3))
    params = targets_of(model)
    before = frozen(params)
    got = record(model.load_weights, params, model.checkpoint())
    assert_unwritten(before, params)
    uses = got.uses
    assert uses["q.weight"] == TensorUse(Use.SLICED, ((0, 4, 8),), ("qkv",))
    # One KV head, two ranks: both ranks keep the whole of k and v.
    assert uses["k.weight"] == TensorUse(Use.REPLICATED, targets=("qkv",))
    assert uses["v.weight"] == TensorUse(Use.REPLICATED, targets=("qkv",))
    assert uses["o.weight"] == TensorUse(Use.SLICED, ((1, 4, 8),), ("o",))
    assert uses["up.weight"] == TensorUse(Use.SLICED, ((0, 8, 16),), ("up",))
    assert uses["norm.weight"] == TensorUse(Use.REPLICATED, targets=("norm",))
    # Vocabulary 13 padded to 16: rank 1 keeps rows 8..13 (clipped to the checkpoint) and zeroes 3.
    assert uses["embed.weight"] == TensorUse(Use.SLICED, ((0, 8, 13),), ("embed",))
    assert [lnd for lnd in got.landings if lnd.target == "embed"] == [
        Landing("embed", ((0, 5), (0, 8)), "copy_", "embed.weight", (((8, 13),), ((0, 8),))),
        Landing("embed", ((5, 8), (0, 8)), "fill_", extra="[0]"),
    ]
    assert uses["rotary.inv_freq"].use is Use.SKIPPED
    assert [uses[f"experts.{e}.weight"].use for e in range(4)] == [Use.SKIPPED, Use.SKIPPED, Use.REPLICATED, Use.REPLICATED]
    # Where each piece lands: q in rows 0..4 of the fused parameter, k and v after it.
    qkv = [(lnd.source, lnd.region) for lnd in got.landings if lnd.target == "qkv"]
    assert qkv == [("q.weight", ((0, 4), (0, 8))), ("k.weight", ((4, 6), (0, 8))), ("v.weight", ((6, 8), (0, 8)))]


def test_kv_heads_are_sliced_when_there_are_as_many_as_ranks():
    model = Rank(rank=1, tp=2, kv_heads=2)
    uses = record(model.load_weights, targets_of(model), model.checkpoint()).uses
    assert uses["k.weight"] == TensorUse(Use.SLICED, ((0, 2, 4),), ("qkv",))
    assert uses["v.weight"] == TensorUse(Use.SLICED, ((0, 2, 4),), ("qkv",))


def test_a_tensor_fused_on_disk_is_several_pieces_in_the_order_of_the_parameter():
    model = Rank(rank=1, tp=2, kv_heads=2)
    tensors = {"qkv.weight": spec(*model.fused_shape())}  # q 0..8, k 8..12, v 12..16
    got = record(model.load_weights, targets_of(model), tensors)
    assert got.uses["qkv.weight"] == TensorUse(Use.SLICED, ((0, 4, 8), (0, 10, 12), (0, 14, 16)), ("qkv",))
    # Rank 0: q 0..4, k 8..10, v 12..14.
    model0 = Rank(rank=0, tp=2, kv_heads=2)
    assert record(model0.load_weights, targets_of(model0), tensors).uses["qkv.weight"].pieces == (
        (0, 0, 4),
        (0, 8, 10),
        (0, 12, 14),
    )


def test_adjacent_pieces_are_merged():
    # One KV head at two ranks: rank 1 keeps q 4..8, then all of k (8..10) and v (10..12): one piece.
    model = Rank(rank=1, tp=2, kv_heads=1)
    tensors = {"qkv.weight": spec(*model.fused_shape())}
    assert record(model.load_weights, targets_of(model), tensors).uses["qkv.weight"].pieces == ((0, 4, 12),)


def test_experts_loaded_through_unsqueeze_and_unbind_into_a_stacked_parameter_are_followed():
    """vLLM's FusedMoE: each expert tensor as ``unsqueeze(0).unbind()``, its rank's rows narrowed
    into that expert's part of a stacked parameter (``param.data[expert]``); the experts of other
    expert-parallel ranks return without a write."""
    rank, shard = 1, 2
    w13 = nn.Parameter(torch.zeros(2, 2 * shard, 3), requires_grad=False)  # experts 2 and 3: gate rows, up rows
    local = {2: 0, 3: 1}

    def load(weights):
        for name, w in weights:
            _, expert, kind = name.split(".")
            for loaded in w.unsqueeze(0).unbind():
                if int(expert) not in local:
                    continue
                data = w13.data[local[int(expert)]]
                part = data.narrow(0, 0 if kind == "w1" else shard, shard)
                part.copy_(loaded.narrow(0, rank * shard, shard))

    tensors = {f"experts.{e}.{kind}": spec(4, 3) for e in range(4) for kind in ("w1", "w3")}
    got = record(load, {"w13": w13}, tensors)
    assert {name: use.use for name, use in got.uses.items() if use.use is not Use.SLICED} == {
        f"experts.{e}.{kind}": Use.SKIPPED for e in (0, 1) for kind in ("w1", "w3")
    }
    assert got.uses["experts.3.w3"] == TensorUse(Use.SLICED, ((0, 2, 4),), ("w13",))
    assert [lnd.region for lnd in got.landings if lnd.source == "experts.3.w3"] == [((1, 2), (2, 4), (0, 3))]
    assert not w13.any()


def test_pieces_follow_where_they_land_not_where_they_are():
    param = nn.Parameter(torch.zeros(4, 2), requires_grad=False)

    def load(weights):
        for _, w in weights:  # the second half of the tensor into the top of the parameter
            param.data[0:2].copy_(w[4:6])
            param.data[2:4].copy_(w[0:2])

    uses = record(load, {"p": param}, {"w": spec(6, 2)}).uses
    assert uses["w"].pieces == ((0, 4, 6), (0, 0, 2))


@pytest.mark.parametrize(
    "op, shape, reason",
    [
        (lambda w: w.t(), (4, 4), "t on it"),
        (lambda w: w.chunk(2)[1], (2, 4), "chunk on it"),
        (lambda w: w[1], (4,), None),  # an int index drops a dim
        (lambda w: w[torch.tensor([0, 1])], (2, 4), None),  # a gather
        (lambda w: w[::2], (2, 4), None),
        (lambda w: w * 2, (4, 4), "mul on it"),
        (lambda w: w.narrow(0, 0, 2).reshape(4, 2), (4, 2), "reshape on it"),
        (lambda w: w.narrow(0, 0, 2).narrow(1, 0, 2), (2, 2), "parts of it cut along dims [0, 1]"),
    ],
)
def test_any_other_op_before_the_copy_leaves_the_tensor_unmapped(op, shape, reason):
    param = nn.Parameter(torch.zeros(shape), requires_grad=False)

    def load(weights):
        for _, w in weights:
            param.data.copy_(op(w))

    use = record(load, {"p": param}, {"w": spec(4, 4)}).uses["w"]
    assert use.use is Use.UNMAPPED
    if reason is not None:
        assert use.reason == reason
    assert not param.any()


def test_a_write_that_is_not_a_box_of_the_parameter_leaves_the_tensor_unmapped():
    param = nn.Parameter(torch.zeros(4, 4), requires_grad=False)

    def load(weights):
        for _, w in weights:
            param.data.view(-1)[2:6].copy_(w)

    use = record(load, {"p": param}, {"w": spec(4)}).uses["w"]
    assert use == TensorUse(Use.UNMAPPED, targets=("p",), reason="written to a part of p that is not a box of it")


def test_a_copy_into_a_tensor_that_is_not_a_parameter_leaves_the_tensor_unmapped():
    param = nn.Parameter(torch.zeros(4), requires_grad=False)

    def load(weights):
        for _, w in weights:
            tmp = torch.empty(4)
            tmp.copy_(w)
            param.data.copy_(tmp)

    use = record(load, {"p": param}, {"w": spec(4)}).uses["w"]
    assert use.use is Use.UNMAPPED and "none of the model's parameters or buffers" in use.reason


def test_an_exception_unmaps_that_tensor_and_the_dry_run_goes_on():
    params = {name: nn.Parameter(torch.zeros(2), requires_grad=False) for name in ("a", "b", "c")}

    def load(weights):
        for name, w in weights:
            if name == "b":
                raise AssertionError("shape mismatch for b")
            params[name].data.copy_(w)

    uses = record(load, params, {name: spec(2) for name in ("a", "b", "c")}).uses
    assert uses["a"].use is Use.REPLICATED and uses["c"].use is Use.REPLICATED
    assert uses["b"] == TensorUse(Use.UNMAPPED, reason="the dry run of load_weights raised AssertionError: shape mismatch for b")


def test_an_exception_in_a_load_weights_that_reads_ahead_blames_the_tensor_it_was_loading():
    """``weights = list(weights)`` hands every stand-in over before the first is loaded: each is
    tried alone, and only the one that fails is unmapped."""
    params = {name: nn.Parameter(torch.zeros(2), requires_grad=False) for name in ("a", "b", "c")}

    def load(weights):
        weights = list(weights)
        for name, w in weights:
            if name == "b":
                w.item()  # a value: the dry run has none
            params[name].data.copy_(w)

    uses = record(load, params, {name: spec(2) for name in ("a", "b", "c")}).uses
    assert uses["a"].use is Use.REPLICATED
    assert uses["b"].use is Use.UNMAPPED and uses["b"].reason.startswith("the dry run of load_weights raised")
    assert uses["c"].use is Use.REPLICATED


def test_an_exception_after_the_last_tensor_unmaps_every_tensor():
    param = nn.Parameter(torch.zeros(2), requires_grad=False)

    def load(weights):
        for _, w in weights:
            param.data.copy_(w)
        raise RuntimeError("post-processing failed")

    uses = record(load, {"p": param}, {"a": spec(2), "b": spec(2)}).uses
    assert {u.use for u in uses.values()} == {Use.UNMAPPED}


def test_a_load_weights_that_raises_before_taking_a_tensor_unmaps_them_all():
    def load(weights):
        raise RuntimeError("not ready")

    uses = record(load, {}, {"a": spec(2), "b": spec(2)}).uses
    assert uses == {
        name: TensorUse(Use.UNMAPPED, reason="the dry run of load_weights raised RuntimeError: not ready") for name in "ab"
    }


def test_a_tensor_the_model_keeps_is_unmapped():
    kept = []
    param = nn.Parameter(torch.zeros(2), requires_grad=False)

    def load(weights):
        for name, w in weights:
            if name == "scale":
                kept.append(w)  # used later, outside load_weights
            else:
                param.data.copy_(w)

    uses = record(load, {"p": param}, {"w": spec(2), "scale": spec(1)}).uses
    assert uses["scale"] == TensorUse(Use.UNMAPPED, reason="the model kept the tensor after load_weights")
    assert uses["w"].use is Use.REPLICATED


def test_buffers_are_targets_too_and_setitem_data_and_scalars_are_seen():
    buf = torch.zeros(3)
    param = nn.Parameter(torch.zeros(1), requires_grad=False)

    def load(weights):
        for name, w in weights:
            if name == "buf":
                buf[1:3] = w.data.detach()[0:2]
            else:
                param.data.copy_(w.view(param.shape))  # a scalar read as shape [1] (vLLM's default loader)

    before = buf.clone()
    got = record(load, {"buf": buf, "p": param}, {"buf": spec(4), "scale": spec()})
    assert torch.equal(buf, before) and not param.any()
    assert got.uses["buf"] == TensorUse(Use.SLICED, ((0, 0, 2),), ("buf",))
    assert got.uses["scale"] == TensorUse(Use.REPLICATED, targets=("p",))


def test_given_pieces_are_followed_back_to_the_checkpoint_tensor():
    """A check run: the stand-in holds only the pieces; the landings name the same parts."""
    model = Rank(rank=1, tp=2, kv_heads=2)
    tensors = model.checkpoint()
    first = record(model.load_weights, targets_of(model), tensors)
    sliced = {name: use.pieces for name, use in first.uses.items() if use.use is Use.SLICED}
    for p in model.parameters():
        p.presliced = True
    second = record(model.load_weights, targets_of(model), tensors, given=sliced)
    assert second.by_target() == first.by_target()


def test_spec_bytes_and_the_slices_argument():
    s = spec(10, 4, dtype=torch.bfloat16)
    assert s.nbytes() == 80 and s.nbytes(((0, 2, 5),)) == 24 and s.nbytes(((1, 0, 1), (1, 3, 4))) == 40
    first = Recording(
        {"a": TensorUse(Use.SLICED, ((0, 0, 5),), ("pa",)), "b": TensorUse(Use.SLICED, ((0, 0, 1), (0, 5, 6)), ("pb",))},
        (Landing("pa", ((0, 5), (0, 4)), "copy_", "a"), Landing("pb", ((0, 2), (0, 4)), "copy_", "b")),
    )
    plan = plan_from(first, {"a": s, "b": s}, {"pa": presliced_flag(None), "pb": presliced_flag(None)})
    assert plan.slices_argument() == {"a": (0, 0, 5), "b": [(0, 0, 1), (0, 5, 6)]}
    assert plan.requested_bytes() == 40 + 16


# --- the plan -----------------------------------------------------------------------------------


def test_a_parameter_that_cannot_take_pieces_gets_all_its_tensors_whole_and_so_do_their_other_parameters():
    tensors = {name: spec(4, 2) for name in ("a", "b", "c", "d")}
    first = Recording(
        {
            "a": TensorUse(Use.SLICED, ((0, 0, 2),), ("p1",)),
            "b": TensorUse(Use.SLICED, ((0, 0, 2),), ("p1", "p2")),
            "c": TensorUse(Use.SLICED, ((0, 0, 2),), ("p2",)),
            "d": TensorUse(Use.SLICED, ((0, 2, 4),), ("p3",)),
        },
        (
            Landing("p1", ((0, 2), (0, 2)), "copy_", "a"),
            Landing("p1", ((2, 4), (0, 2)), "copy_", "b"),
            Landing("p2", ((0, 2), (0, 2)), "copy_", "b"),
            Landing("p2", ((2, 4), (0, 2)), "copy_", "c"),
            Landing("p3", ((0, 2), (0, 2)), "copy_", "d"),
        ),
    )
    flag = presliced_flag(None)
    plan = plan_from(first, tensors, {"p2": flag, "p3": flag})  # p1 has no way to take pieces
    assert plan.slices == {"d": ((0, 2, 4),)}
    assert set(plan.marked) == {"p3"}
    assert plan.whole["a"] == plan.whole["b"] == "p1 has no way to take a pre-sliced tensor"
    assert plan.whole["c"] == "p2 also loads b, which goes whole"
    assert plan.select == ["a", "b", "c", "d"]


def test_the_plan_marks_what_its_check_run_loads_alike_and_the_cut_load_equals_the_full_load():
    model = Rank(rank=1, tp=2, kv_heads=1, experts=(2, 3))
    tensors = model.checkpoint()
    plan = plan_shards(model, tensors, handoff=presliced_flag)
    assert set(plan.marked) == {"qkv", "o", "up", "embed"}
    assert plan.select == [n for n in tensors if n not in ("rotary.inv_freq", "experts.0.weight", "experts.1.weight")]
    assert plan.fallbacks == {}
    assert not any(hasattr(p, "presliced") for p in model.parameters())  # the dry runs left no mark

    full = full_tensors(tensors)
    reference = Rank(rank=1, tp=2, kv_heads=1, experts=(2, 3))
    reference.load_weights(full.items())
    with plan.loading(model):
        assert all(getattr(model.get_parameter(name), "presliced", False) for name in plan.marked)
        model.load_weights(
            (name, cut(full[name], plan.slices[name]) if name in plan.slices else full[name]) for name in plan.select
        )
    assert not any(hasattr(p, "presliced") for p in model.parameters())
    for name, p in reference.named_parameters():
        assert torch.equal(model.get_parameter(name), p), name
    kept = sum(p.numel() * p.element_size() for p in model.parameters())
    padding = 3 * Rank.HIDDEN * 4  # the embedding's zeroed rows
    assert plan.requested_bytes() == kept - padding


def test_a_parameter_whose_check_run_differs_falls_back_to_full_tensors():
    """The fused-on-disk path narrows at full offsets even when the parameter is marked (as vLLM's
    does): its tensor goes whole, the rest stays in pieces, and both loads agree."""
    model = Rank(rank=0, tp=2, kv_heads=2)
    tensors = {**{k: v for k, v in model.checkpoint().items() if k[0] not in "qkv"}, "qkv.weight": spec(*model.fused_shape())}
    plan = plan_shards(model, tensors, handoff=presliced_flag)
    assert plan.uses["qkv.weight"].use is Use.SLICED
    assert plan.fallbacks == {
        "qkv.weight": "qkv: the dry run of load_weights raised AssertionError: (torch.Size([4, 8]), torch.Size([8, 8])) (for qkv.weight, in pieces)"
    }
    assert set(plan.marked) == {"o", "up", "embed"}

    full = full_tensors(tensors)
    reference = Rank(rank=0, tp=2, kv_heads=2)
    reference.load_weights(full.items())
    with plan.loading(model):
        model.load_weights(
            (name, cut(full[name], plan.slices[name]) if name in plan.slices else full[name]) for name in plan.select
        )
    for name, p in reference.named_parameters():
        assert torch.equal(model.get_parameter(name), p), name


def test_without_a_handoff_every_tensor_goes_whole():
    model = Rank(rank=1, tp=2)
    tensors = model.checkpoint()
    plan = plan_shards(model, tensors, handoff=lambda param: None)
    assert plan.slices == {} and plan.marked == {}
    assert plan.requested_bytes() == sum(tensors[n].nbytes() for n in plan.select)
    assert "embed.weight" in plan.fallbacks and "norm.weight" not in plan.fallbacks


def test_the_summary_names_the_fallbacks():
    model = Rank(rank=0, tp=2)
    plan = plan_shards(model, model.checkpoint(), handoff=lambda param: None)
    text = plan.summary()
    assert text.startswith("0 tensors in pieces, 3 whole, 3 not loaded on this rank, 6 whole as a fallback;")
    assert "q.weight (qkv has no way to take a pre-sliced tensor)" in text
    total = sum(s.nbytes() for s in model.checkpoint().values())
    assert f"; {plan.requested_bytes()} of {total} bytes;" in text
