"""Selection and planning: exact examples, then properties over generated checkpoints."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from streamer_client.errors import ConfigError, SelectionError
from streamer_service.checkpoint.header import TensorInfo
from streamer_service.checkpoint.plan import Batch, BatchKind, FileRange, Part, Plan, build_plan, in_parts, select, union_order


def tensor(name: str, offset: int, nbytes: int, file: str = "a.safetensors", dtype: str = "U8") -> TensorInfo:
    return TensorInfo(name=name, dtype=dtype, shape=(nbytes,), file=file, offset=offset, nbytes=nbytes)


def laid_out(file: str, sizes: dict[str, int], start: int = 8) -> list[TensorInfo]:
    """Tensors back to back in ``file`` from ``start``, like a safetensors data section."""
    out = []
    for name, size in sizes.items():
        out.append(tensor(name, start, size, file))
        start += size
    return out


# A small checkpoint in checkpoint order: two files.
CATALOG = laid_out(
    "model-1.safetensors",
    {"embed.weight": 10, "layer.1.attn": 5, "layer.1.mlp": 5, "layer.10.attn": 5, "layer.10.mlp": 5},
) + laid_out("model-2.safetensors", {"layer.2.attn": 5, "layer.2.mlp": 5, "lm_head.weight": 10, "norm": 2})


def names(tensors) -> list[str]:
    return [t.name for t in tensors]


# --------------------------------------------------------------------------- select


def test_select_none_takes_everything_in_checkpoint_order():
    assert select(CATALOG) == CATALOG


def test_select_names_and_prefixes_keep_checkpoint_order():
    got = select(CATALOG, ["norm", "layer.1.", "embed.weight"])
    assert names(got) == ["embed.weight", "layer.1.attn", "layer.1.mlp", "norm"]


def test_plain_prefix_is_a_string_prefix():
    # "layer.1" is no tensor name, so it is a prefix, and it also covers layer.10.
    assert names(select(CATALOG, ["layer.1"])) == ["layer.1.attn", "layer.1.mlp", "layer.10.attn", "layer.10.mlp"]


def test_an_exact_name_is_a_name_even_when_it_prefixes_others():
    catalog = laid_out("a", {"w": 1, "w_scale": 1, "w_scale_inv": 1})
    assert names(select(catalog, ["w", "w_scale"])) == ["w", "w_scale"]


@pytest.mark.parametrize(
    "entries, message",
    [
        ([], "selection is empty"),
        (["nope"], "'nope' matches no tensor"),
        (["layer.1.", "nope.", "norm"], "'nope.' matches no tensor"),
        (["norm", "norm"], "'norm' is given twice"),
        ([""], "not a non-empty string"),
        ([None], "not a non-empty string"),
        (["layer.", "layer.1.attn"], "prefix 'layer.' also covers 'layer.1.attn'"),
        (["layer.1", "layer.10."], "prefix 'layer.1' also covers 'layer.10.'"),
        ("norm", "got the string 'norm'"),
    ],
)
def test_bad_selections_fail_closed(entries, message):
    with pytest.raises(SelectionError, match=message):
        select(CATALOG, entries)


def test_priority_groups_first_in_entry_order_then_checkpoint_order():
    got = select(CATALOG, priority=["lm_head.", "layer.2.", "norm"])
    assert names(got) == [
        "lm_head.weight",
        "layer.2.attn",
        "layer.2.mlp",
        "norm",
        "embed.weight",
        "layer.1.attn",
        "layer.1.mlp",
        "layer.10.attn",
        "layer.10.mlp",
    ]


def test_priority_applies_within_the_selection():
    got = select(CATALOG, ["layer.", "norm"], priority=["norm"])
    assert names(got)[0] == "norm" and len(got) == 7


@pytest.mark.parametrize(
    "priority, message",
    [
        (["embed."], "priority entry 'embed.' matches no selected tensor"),
        (["norm", "norm"], "given twice"),
        (["layer.", "layer.2."], "prefix 'layer.' also covers 'layer.2.'"),
        ([], "priority is empty"),
    ],
)
def test_bad_priorities_fail_closed(priority, message):
    with pytest.raises(SelectionError, match=message):
        select(CATALOG, ["layer.", "norm"], priority=priority)


# --------------------------------------------------------------------------- build_plan


def test_contiguous_tensors_coalesce_into_one_range():
    plan = build_plan(select(CATALOG), slot_size=1000, align=1)
    (batch,) = plan.batches
    assert batch.kind is BatchKind.SLOT
    assert batch.ranges == (
        FileRange("model-1.safetensors", 8, 30, 0),
        FileRange("model-2.safetensors", 8, 22, 30),
    )
    assert [p.buffer_offset for p in batch.placements] == [0, 10, 15, 20, 25, 30, 35, 40, 50]


def test_ranges_start_congruent_to_their_file_offset():
    plan = build_plan(select(CATALOG), slot_size=10_000, align=64)
    (batch,) = plan.batches
    assert [(r.offset, r.buffer_offset) for r in batch.ranges] == [(8, 8), (8, 72)]
    assert batch.buffer_bytes == 72 + 22


def test_only_consecutive_tensors_coalesce():
    tensors = laid_out("a", {"x": 4, "y": 4, "z": 4})
    plan = build_plan([tensors[0], tensors[2], tensors[1]], slot_size=100, align=1)
    assert [(r.offset, r.nbytes) for r in plan.batches[0].ranges] == [(8, 4), (16, 4), (12, 4)]


def test_slots_are_packed_without_splitting_a_tensor():
    tensors = laid_out("a", {"x": 6, "y": 6, "z": 6})
    plan = build_plan(tensors, slot_size=13, align=1)
    assert [names(p.tensor for p in b.placements) for b in plan.batches] == [["x", "y"], ["z"]]
    assert [b.ranges for b in plan.batches] == [
        (FileRange("a", 8, 12, 0),),
        (FileRange("a", 20, 6, 0),),
    ]


def test_a_tensor_larger_than_a_slot_is_oversized_and_read_in_parts():
    tensors = laid_out("a", {"small": 4, "huge": 25, "tail": 4})
    plan = build_plan(tensors, slot_size=10, align=1)
    assert [b.kind for b in plan.batches] == [BatchKind.SLOT, BatchKind.OVERSIZED, BatchKind.SLOT]
    huge = plan.batches[1]
    assert [(r.offset, r.nbytes, r.buffer_offset) for r in huge.ranges] == [(12, 10, 0), (22, 10, 10), (32, 5, 20)]
    assert huge.buffer_bytes == 25 and plan.oversized_bytes == 25 and plan.slot_bytes == 4


def test_empty_tensors_need_no_range_and_do_not_break_coalescing():
    tensors = laid_out("a", {"x": 4, "empty": 0, "y": 4})
    plan = build_plan(tensors, slot_size=100, align=1)
    (batch,) = plan.batches
    assert batch.ranges == (FileRange("a", 8, 8, 0),)
    assert [p.buffer_offset for p in batch.placements] == [0, 4, 4]
    (only_empty,) = build_plan([tensor("e", 8, 0)], slot_size=100).batches
    assert (only_empty.ranges, only_empty.buffer_bytes, len(only_empty.placements)) == ((), 0, 1)


def test_plan_rejects_bad_arguments():
    with pytest.raises(ConfigError):
        build_plan(CATALOG, slot_size=0)
    with pytest.raises(ConfigError):
        build_plan(CATALOG, slot_size=10, align=3)
    with pytest.raises(SelectionError, match="'norm' is planned twice"):
        build_plan(CATALOG + [CATALOG[-1]], slot_size=100)


def test_plan_is_frozen():
    plan = build_plan(CATALOG, slot_size=100)
    with pytest.raises(AttributeError, match="can't set attribute"):
        plan.slot_size = 5  # type: ignore[misc]


# --------------------------------------------------------------------------- properties


@st.composite
def checkpoints(draw) -> list[TensorInfo]:
    """1-3 files, each a data section tiled by tensors (some empty), in checkpoint order."""
    tensors = []
    for f in range(draw(st.integers(1, 3))):
        sizes = draw(st.lists(st.integers(0, 3000), min_size=1, max_size=12))
        start = draw(st.integers(8, 5000))
        tensors += laid_out(f"f{f}", {f"f{f}.t{i}": size for i, size in enumerate(sizes)}, start)
    return tensors


@st.composite
def deliveries(draw) -> list[TensorInfo]:
    """A selection in some delivery order: checkpoint order, a subsequence, or shuffled."""
    tensors = draw(checkpoints())
    kind = draw(st.sampled_from(["all", "subsequence", "shuffled"]))
    if kind == "subsequence":
        keep = draw(st.lists(st.booleans(), min_size=len(tensors), max_size=len(tensors)))
        tensors = [t for t, k in zip(tensors, keep) if k]
    elif kind == "shuffled":
        tensors = draw(st.permutations(tensors))
    return list(tensors)


def _check_plan(plan: Plan, delivery: list[TensorInfo]) -> None:
    # Every tensor exactly once, in delivery order.
    assert plan.tensors == tuple(delivery)
    for batch in plan.batches:
        _check_batch(batch, plan)
    _check_ranges_cover_exactly_the_tensors(plan, delivery)


def _check_batch(batch: Batch, plan: Plan) -> None:
    extents = sorted((r.buffer_offset, r.buffer_offset + r.nbytes) for r in batch.ranges)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(extents, extents[1:]))
    assert all(0 <= start and end <= batch.buffer_bytes for start, end in extents)
    assert all((r.buffer_offset - r.offset) % plan.align == 0 for r in batch.ranges)
    for placement in batch.placements:
        t = placement.tensor
        if t.nbytes == 0:
            assert 0 <= placement.buffer_offset <= batch.buffer_bytes
            continue
        holders = [r for r in batch.ranges if r.file == t.file and r.offset <= t.offset and t.end <= r.end]
        if batch.kind is BatchKind.SLOT:
            (r,) = holders
            assert placement.buffer_offset == r.buffer_offset + (t.offset - r.offset)
    if batch.kind is BatchKind.SLOT:
        assert batch.buffer_bytes <= plan.slot_size
        assert all(t.nbytes <= plan.slot_size for t in (p.tensor for p in batch.placements))
        # Coalescing is maximal within a slot: no two consecutive ranges could have been one.
        for a, b in zip(batch.ranges, batch.ranges[1:]):
            assert not (a.file == b.file and a.end == b.offset)
    else:
        (placement,) = batch.placements
        t = placement.tensor
        assert (t.offset % plan.align) + t.nbytes > plan.slot_size
        assert all(r.nbytes <= plan.slot_size for r in batch.ranges)
        assert batch.ranges[0].offset == t.offset and batch.ranges[-1].end == t.end
        assert [(r.offset - t.offset) for r in batch.ranges] == [
            (r.buffer_offset - placement.buffer_offset) for r in batch.ranges
        ]


def _check_ranges_cover_exactly_the_tensors(plan: Plan, delivery: list[TensorInfo]) -> None:
    ranges = sorted((r.file, r.offset, r.end) for b in plan.batches for r in b.ranges)
    for (f1, _, end1), (f2, start2, _) in zip(ranges, ranges[1:]):
        assert f1 != f2 or end1 <= start2, "ranges overlap: a byte would be read twice"
    # Disjoint ranges whose union holds every (disjoint) tensor and that add up to the same
    # bytes cover exactly the tensors. (An oversized tensor spans several adjacent parts.)
    assert sum(end - start for _, start, end in ranges) == sum(t.nbytes for t in delivery)
    union = _merged(ranges)
    for t in delivery:
        if t.nbytes:
            assert any(f == t.file and s <= t.offset and t.end <= e for f, s, e in union)


def _merged(ranges: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    merged: list[tuple[str, int, int]] = []
    for file, start, end in ranges:
        if merged and merged[-1][0] == file and merged[-1][2] == start:
            merged[-1] = (file, merged[-1][1], end)
        else:
            merged.append((file, start, end))
    return merged


@settings(max_examples=400, deadline=None)
@given(delivery=deliveries(), slot_size=st.integers(1, 8000), align=st.sampled_from([1, 8, 64, 512, 4096]))
def test_plan_properties(delivery, slot_size, align):
    plan = build_plan(delivery, slot_size, align=align)
    _check_plan(plan, delivery)
    assert plan.slot_bytes <= slot_size


@given(delivery=deliveries(), slot_size=st.integers(64, 8000), align=st.sampled_from([1, 8, 64]), extra=st.integers(0, 64))
def test_in_parts_reads_each_oversized_tensor_in_slot_sized_parts_in_the_same_order(delivery, slot_size, align, extra):
    plan = build_plan(delivery, slot_size, align=align)
    slot_bytes = max(plan.slot_bytes, slot_size) + extra  # a reader's slots may be rounded up
    parted = in_parts(plan, slot_bytes)
    assert all(b.kind is BatchKind.SLOT and b.buffer_bytes <= slot_bytes for b in parted.batches)
    # The batches that fit a slot are untouched and keep their order among the parts.
    assert [b for b in parted.batches if not isinstance(b.placements[0] if b.placements else None, Part)] == [
        b for b in plan.batches if b.kind is BatchKind.SLOT
    ]
    delivered = [p.tensor for b in parted.batches for p in b.placements if not isinstance(p, Part) or p.last]
    assert delivered == list(plan.tensors)
    for batch in (b for b in plan.batches if b.kind is BatchKind.OVERSIZED):
        big = batch.placements[0].tensor
        parts = [b for b in parted.batches if any(isinstance(p, Part) and p.tensor is big for p in b.placements)]
        ranges = [b.ranges[0] for b in parts]
        assert all(len(b.ranges) == len(b.placements) == 1 for b in parts)
        assert ranges[0].offset == big.offset and ranges[-1].end == big.end
        assert all(x.end == y.offset and y.offset % align == 0 for x, y in zip(ranges, ranges[1:]))
        for b, r in zip(parts, ranges):
            part = b.placements[0]
            assert (part.start, part.nbytes, part.buffer_offset) == (r.offset - big.offset, r.nbytes, r.buffer_offset)
            assert r.buffer_offset == r.offset % align and r.file == big.file
        assert [p.placements[0].last for p in parts] == [False] * (len(parts) - 1) + [True]


def test_in_parts_needs_a_slot_of_at_least_the_alignment():
    plan = build_plan([tensor("big", 8, 10_000)], 4096)
    assert in_parts(build_plan([tensor("a", 8, 100)], 4096), 100) == build_plan([tensor("a", 8, 100)], 4096)
    with pytest.raises(ConfigError, match="at least the alignment"):
        in_parts(plan, 4095)


@settings(max_examples=200, deadline=None)
@given(tensors=checkpoints(), data=st.data())
def test_select_then_plan_delivers_priority_first_then_checkpoint_order(tensors, data):
    chosen_names = data.draw(st.lists(st.sampled_from([t.name for t in tensors]), min_size=1, unique=True))
    chosen = select(tensors, chosen_names)
    assert chosen == [t for t in tensors if t.name in set(chosen_names)]
    first = data.draw(st.sampled_from(chosen))
    ordered = select(tensors, chosen_names, priority=[first.name])
    assert ordered[0] == first and ordered[1:] == [t for t in chosen if t is not first]
    _check_plan(build_plan(ordered, 4096, align=64), ordered)


# --------------------------------------------------------------------------- one order for both modes


@st.composite
def group_selections(draw):
    """A checkpoint, 1-4 ranks' selections (names and prefixes), and the group's priority entries."""
    tensors = draw(checkpoints())
    entries = sorted({t.name[:k] for t in tensors for k in range(1, len(t.name) + 1)})
    some = st.lists(st.sampled_from(entries), min_size=1, max_size=4, unique=True)
    priority = draw(st.one_of(st.none(), some))
    selections = draw(st.lists(st.one_of(st.none(), some), min_size=1, max_size=4))
    return tensors, selections, priority


@settings(max_examples=300, deadline=None)
@given(group_selections())
def test_daemon_order_is_embedded_order_for_every_rank(case):
    """A rank gets its tensors in the order ``select`` gives it in-process, whether it
    loads alone or in a group whose union the daemon orders."""
    tensors, selections, priority = case
    try:
        chosen = [select(tensors, s, priority) for s in selections]
    except SelectionError:
        assume(False)
    daemon = union_order(tensors, [(c, priority) for c in chosen])
    for embedded in chosen:
        mine = {t.name for t in embedded}
        assert [t for t in daemon if t.name in mine] == embedded
    assert {t.name for t in daemon} == {t.name for c in chosen for t in c}


def test_a_priority_entry_naming_a_tensor_is_that_name_for_a_rank_that_does_not_select_it():
    """``w`` names a tensor of the checkpoint: it is that name, never the prefix of ``w_scale``,
    whether or not a rank selects ``w``; so a rank and a group of ranks read it alike."""
    catalog = laid_out("a", {"w": 1, "w_scale": 1, "x": 1})
    with pytest.raises(SelectionError, match="priority entry 'w' matches no selected tensor"):
        select(catalog, ["w_scale", "x"], priority=["w"])
    alone = select(catalog, None, priority=["w"])
    assert names(alone) == ["w", "w_scale", "x"]
    assert names(union_order(catalog, [(alone, ["w"]), (select(catalog, ["x"]), None)])) == ["w", "w_scale", "x"]


def test_union_order_puts_each_ranks_priority_entries_in_rank_order():
    rank0 = select(CATALOG, ["layer.2.", "norm"], ["norm"])
    rank1 = select(CATALOG, ["layer.1.", "layer.10."], ["layer.10."])
    order = union_order(CATALOG, [(rank0, ["norm"]), (rank1, ["layer.10."])])
    assert names(order) == ["norm", "layer.10.attn", "layer.10.mlp", "layer.1.attn", "layer.1.mlp", "layer.2.attn", "layer.2.mlp"]
