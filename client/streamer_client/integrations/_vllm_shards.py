"""Which part of each checkpoint tensor a vLLM rank keeps, learned from vLLM's own weight loaders,
and how vLLM takes tensors already cut to it.

Under tensor parallelism vLLM hands ``model.load_weights`` full tensors, and each parallel layer's
``weight_loader`` narrows them to the rank's shard as it copies them into its parameter. To ask
storage for that shard alone, the loader must know it before it streams: a dry run of
``model.load_weights`` on the built model (:mod:`._dry_run`) records what each loader narrows and
where it copies it, writing nothing; each checkpoint tensor is then replicated, sliced (pieces
``(dim, start, stop)`` along one dim, in torch dimensions, ordered as they land), skipped or
unmapped (:mod:`._tensor_use`).

**Handing vLLM pre-sliced tensors.** A parameter that receives a sliced tensor must not narrow it
again. In vLLM 0.32.0 the loaders that narrow are of three kinds (:func:`handoff_for`):

- a ``BasevLLMParameter`` (the weights of the linear layers, loaded by ``weight_loader_v2``)
  narrows at ``param.tp_rank`` times its shard size (``load_column_parallel_weight``,
  ``load_merged_column_weight``, ``load_qkv_weight``, ``load_row_parallel_weight``); with
  ``tp_rank`` 0 while the rank loads, that narrow takes the whole pre-sliced tensor, as it does for
  vLLM's own replicated (``disable_tp``) layers;
- a plain ``Parameter`` loaded by a linear layer's ``weight_loader`` (biases) skips its narrow
  where the parameter has ``is_sharded_weight`` set, the flag of vLLM's sharded-checkpoint loaders;
- the weight of a ``VocabParallelEmbedding`` / ``ParallelLMHead`` has no such flag: while the rank
  loads it gets a loader that does what vLLM's does after its narrow (the shard's rows into the top
  of the parameter, the padding rows below them zeroed). The last rank's shard of a padded
  vocabulary is clipped to the checkpoint's rows by vLLM itself, so its piece is too.

Nothing is trusted on its kind alone: a second dry run, with stand-ins cut as storage will cut them
and the parameters marked, must write exactly the same parts of the same tensors into every
parameter as the first. A parameter that does not, that has no way to take a pre-sliced tensor, or
that also loads a tensor requested whole as a fallback, gets every one of its tensors whole, and so
does every other parameter those tensors feed; vLLM then narrows them as usual. The marks are taken
off again once the rank has loaded (:meth:`ShardPlan.loading`), so a later ``load_weights`` with
full tensors (a weight update) narrows as vLLM always does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckpointError
from ._dry_run import record
from ._tensor_use import Piece, Recording, TensorSpec, TensorUse, Use

__all__ = ["Handoff", "ShardPlan", "check", "handoff_for", "plan_from", "plan_shards"]


@dataclass(frozen=True)
class Handoff:
    """How one parameter takes a pre-sliced tensor: ``attr`` set to ``value`` while the rank loads."""

    how: str
    attr: str
    value: Any

    @contextlib.contextmanager
    def applied(self, param: torch.Tensor) -> Iterator[None]:
        had = self.attr in vars(param)
        before = vars(param).get(self.attr)
        setattr(param, self.attr, self.value)
        try:
            yield
        finally:
            if had:
                setattr(param, self.attr, before)
            else:
                delattr(param, self.attr)


@dataclass(frozen=True)
class ShardPlan:
    """One rank's request: which tensors, which of them in pieces, and which parameters take them so."""

    tensors: Mapping[str, TensorSpec]
    uses: Mapping[str, TensorUse]  # the first dry run's
    slices: dict[str, tuple[Piece, ...]]  # requested in pieces
    whole: dict[str, str] = field(default_factory=dict)  # requested whole: why ("" where used whole)
    marked: dict[str, Handoff] = field(default_factory=dict)  # parameter: how it takes its pieces

    @property
    def select(self) -> list[str]:
        """The names to request, in checkpoint order (the skipped ones are not)."""
        return [name for name in self.tensors if name in self.slices or name in self.whole]

    def slices_argument(self) -> dict[str, Piece | list[Piece]]:
        """``slices=`` for :func:`streamer_client.stream`: one piece as a tuple, several as a list."""
        return {name: pieces[0] if len(pieces) == 1 else list(pieces) for name, pieces in self.slices.items()}

    @property
    def fallbacks(self) -> dict[str, str]:
        """Tensors requested whole though the rank keeps less of them (or did not say what): why."""
        return {name: why for name, why in self.whole.items() if why}

    def requested_bytes(self) -> int:
        return sum(self.tensors[name].nbytes(self.slices.get(name, ())) for name in self.select)

    @contextlib.contextmanager
    def loading(self, model: torch.nn.Module) -> Iterator[None]:
        """The marked parameters take pre-sliced tensors inside this block, and narrow as before after it."""
        params = dict(model.named_parameters())
        with contextlib.ExitStack() as stack:
            for name, handoff in self.marked.items():
                stack.enter_context(handoff.applied(params[name]))
            yield

    def summary(self) -> str:
        counts = {use: 0 for use in Use}
        for use in self.uses.values():
            counts[use.use] += 1
        fallbacks = self.fallbacks
        text = (
            f"{len(self.slices)} tensors in pieces, {len(self.whole) - len(fallbacks)} whole, "
            f"{counts[Use.SKIPPED]} not loaded on this rank, {len(fallbacks)} whole as a fallback; "
            f"{self.requested_bytes()} of {sum(spec.nbytes() for spec in self.tensors.values())} bytes"
        )
        if fallbacks:
            text += "; whole: " + "; ".join(f"{name} ({why})" for name, why in fallbacks.items())
        return text


def plan_from(
    first: Recording,
    tensors: Mapping[str, TensorSpec],
    handoffs: Mapping[str, Handoff],
    failed: Mapping[str, str] | None = None,
) -> ShardPlan:
    """The plan a first dry run allows: a tensor goes in pieces only where every parameter it
    feeds can take pieces (``handoffs``), did not fail the check (``failed``: parameter: why) and
    loads no tensor that goes whole."""
    failed = failed or {}
    sources: dict[str, list[str]] = {}
    for landing in first.landings:
        if landing.source is not None and landing.source not in sources.setdefault(landing.target, []):
            sources[landing.target].append(landing.source)
    whole = {
        name: (use.reason if use.use is Use.UNMAPPED else "")
        for name, use in first.uses.items()
        if use.use in (Use.REPLICATED, Use.UNMAPPED)
    }
    sliced = {name for name, use in first.uses.items() if use.use is Use.SLICED}
    changed = True
    while changed:
        changed = False
        for target, names in sources.items():
            cut = [name for name in names if name in sliced]
            if not cut:
                continue
            why = None
            if target not in handoffs:
                why = f"{target} has no way to take a pre-sliced tensor"
            elif target in failed:
                why = failed[target]
            else:
                loose = next((name for name in names if whole.get(name)), None)
                if loose is not None:
                    why = f"{target} also loads {loose}, which goes whole"
            if why is not None:
                for name in cut:
                    sliced.discard(name)
                    whole[name] = why
                changed = True
    marked = {target: handoffs[target] for target, names in sources.items() if any(name in sliced for name in names)}
    return ShardPlan(
        tensors=dict(tensors),
        uses=first.uses,
        slices={name: first.uses[name].pieces for name in tensors if name in sliced},
        whole={name: whole[name] for name in tensors if name in whole},
        marked=marked,
    )


def check(first: Recording, second: Recording, plan: ShardPlan) -> dict[str, str]:
    """The parameters a second dry run (the plan's request, the plan's marks) wrote otherwise than
    the first: parameter: why."""
    failed = {}
    for name, use in second.uses.items():
        if use.use is Use.UNMAPPED and first.uses[name].use is not Use.UNMAPPED:
            how = "in pieces" if name in plan.slices else "whole"
            for target in first.uses[name].targets:
                failed.setdefault(target, f"{target}: {use.reason} (for {name}, {how})")
    a, b = first.by_target(), second.by_target()
    for target in a.keys() | b.keys():
        if a.get(target, []) != b.get(target, []):
            failed.setdefault(target, f"{target} took its pieces otherwise than the full load takes its shard")
    return failed


def plan_shards(
    model: torch.nn.Module,
    tensors: Mapping[str, TensorSpec],
    *,
    handoff: Callable[[torch.nn.Parameter], Handoff | None] | None = None,
    rounds: int = 4,
) -> ShardPlan:
    """This rank's plan for ``model`` (built, with its parallel layout) and the checkpoint's
    ``tensors`` (name: spec, in checkpoint order): two or more dry runs of ``model.load_weights``.

    ``handoff(param)`` says how a parameter takes pre-sliced tensors (default: :func:`handoff_for`,
    vLLM's layers). The plan returned is one whose last dry run wrote every parameter exactly as the
    first did; where no such plan is found in ``rounds``, every tensor the rank loads goes whole.
    """
    handoff = handoff or handoff_for
    params = dict(model.named_parameters())
    targets = {**params, **dict(model.named_buffers())}
    first = record(model.load_weights, targets, tensors)
    handoffs = {}
    for name in first.by_target():
        found = handoff(params[name]) if name in params else None
        if found is not None:
            handoffs[name] = found
    failed: dict[str, str] = {}
    for _ in range(rounds):
        plan = plan_from(first, tensors, handoffs, failed)
        if not plan.marked:
            return plan
        requested = {name: tensors[name] for name in plan.select}
        with plan.loading(model):
            second = record(model.load_weights, targets, requested, given=plan.slices)
        more = check(first, second, plan)
        if not more:
            return plan
        if not set(more) - set(plan.marked):
            failed.update(more)
            continue
        break  # a parameter nobody marked changed: the plan's request itself is not what vLLM loads
    why = "no plan whose check wrote every parameter as vLLM's own loader does"
    return ShardPlan(
        tensors=dict(tensors),
        uses=first.uses,
        slices={},
        whole={
            name: (why if use.use is Use.SLICED else use.reason) for name, use in first.uses.items() if use.use is not Use.SKIPPED
        },
    )


# --- vLLM's layers ------------------------------------------------------------------------------


def handoff_for(param: torch.nn.Parameter) -> Handoff | None:
    """How ``param`` of a vLLM 0.32.0 model takes a pre-sliced tensor, or None (see the module's
    docstring); checked by a dry run before it is used."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.parameter import BasevLLMParameter

    if isinstance(param, BasevLLMParameter):
        return Handoff("tp_rank 0 while loading", "tp_rank", 0)
    loader = getattr(param, "weight_loader", None)
    layer = getattr(loader, "__self__", None)
    if isinstance(layer, LinearBase) and getattr(loader, "__name__", "") == "weight_loader":
        return Handoff("is_sharded_weight", "is_sharded_weight", True)
    if (
        isinstance(layer, VocabParallelEmbedding)
        and getattr(param, "output_dim", None) == 0
        and getattr(param, "packed_dim", None) is None
    ):
        return Handoff("vocabulary rows loader", "weight_loader", _vocab_rows_loader(layer))
    return None


def _vocab_rows_loader(layer) -> Callable[[torch.nn.Parameter, torch.Tensor], None]:
    """What ``VocabParallelEmbedding.weight_loader`` does with the rows it narrowed to: copied into
    the top of the parameter, the padding rows below them zeroed."""

    def load_vocab_rows(param: torch.nn.Parameter, loaded_weight: torch.Tensor) -> None:
        indices = layer.shard_indices
        rows = indices.org_vocab_end_index - indices.org_vocab_start_index
        if loaded_weight.shape[0] != rows:
            raise CheckpointError(
                f"{layer.__class__.__name__} {getattr(layer, 'prefix', '') or ''}: a pre-sliced vocabulary shard of "
                f"{loaded_weight.shape[0]} rows where this rank keeps {rows} (rows {indices.org_vocab_start_index} to "
                f"{indices.org_vocab_end_index} of the checkpoint)"
            )
        param[: loaded_weight.shape[0]].data.copy_(loaded_weight)
        param[loaded_weight.shape[0] :].data.fill_(0)

    return load_vocab_rows
