"""Ulysses sequence parallelism: one packed row computed by the S ranks of a sequence group.

Every rank of the group passes the same groups, so every rank builds the same plan and the same rows. For
everything outside attention (embedding, norms, MLP, the decoder's own per-token work) a rank holds one slice of
the row's tokens: the row is padded at its end to Lp = S * Ls tokens and rank r holds tokens r*Ls .. (r+1)*Ls - 1.
Around the cascade, one all-to-all turns the (1, H, Ls, D) query shard into (1, H/S, Lp, D), the whole row for
H/S heads (key and value likewise: Hkv/S heads each, or, where Hkv < S, each of the Hkv heads replicated S/Hkv
times so that every rank gets the one its query heads read, as verl does); the unchanged cascade runs on the row's
first L tokens for those heads (the pad tokens are keys of no query, their outputs zero), and a second all-to-all
turns the (1, Lp, H/S, Dv) result back into (1, Ls, H, Dv). Cached prompt K/V are what the cascade sees: per head
shard. The decoder's final hidden states are gathered back into the whole (L, d) row, so the LM head, the loss
and the results are computed whole, identically, on every rank.

Gradients. Both exchanges are linear maps with an exact adjoint (the inverse exchange); the gather's adjoint is
the sum over the ranks of the incoming gradients, sliced to the rank's tokens. Each rank backpropagates its loss
scaled by 1/S (``loss_scale``): the gathered hidden states then receive exactly the gradient of one loss, the
head's parameters 1/S of theirs on each rank, the others their rank's share. The sum over the group of every
parameter's gradient is therefore the full gradient: all-reduced over the group at the end of the call
(``reduce_grads``), or, under FSDP2 over a mesh that holds the group, by FSDP2's own reduce-scatter.

Agreement: before any exchange, the ranks of a sequence group all-gather whether each set up its call and a digest
of what it will compute (every segment's tokens, parent and trained tokens, the budget and the call's settings:
``digest``). A rank that failed makes every rank raise (itself its own error, the others one naming it), and
digests that differ (ranks that passed different groups) make every rank raise one ValueError, instead of the ranks
waiting in an exchange or computing rows that do not belong together (``agree``). Under DDP / FSDP2 the agreement
over the data-parallel ranks follows it, so ranks of other sequence groups stop too.

Notation: S = ranks of the sequence group, L = packed row length, Lp = L padded to a multiple of S, Ls = Lp / S,
H / Hkv = query / key-value heads, D / Dv = head dims, d = hidden size.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _exchange(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` into S chunks along ``scatter_dim``, send chunk j to rank j, concatenate what rank j sent along
    ``gather_dim`` (in rank order)."""
    size = dist.get_world_size(group)
    parts = [p.contiguous() for p in x.chunk(size, dim=scatter_dim)]
    out = [torch.empty_like(parts[0]) for _ in range(size)]
    dist.all_to_all(out, parts, group=group)
    return torch.cat(out, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """The exchange; its backward is the inverse exchange (gather and scatter dims swapped)."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, g):
        scatter_dim, gather_dim = ctx.dims
        return _exchange(g, ctx.group, gather_dim, scatter_dim), None, None, None


class _Gather(torch.autograd.Function):
    """(Ls, ...) per rank -> (Lp, ...) on every rank; backward: the sum over the ranks, the rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size = dist.get_world_size(group)
        out = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(out, x.contiguous(), group=group)
        return torch.cat(out)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return g.chunk(size)[rank], None


def comm_device(group=None) -> torch.device:
    """Where ``group``'s collectives take their tensors (None: the default group): the current GPU under nccl, else
    the CPU."""
    return (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    )


def digest(plan, *settings) -> int:
    """A 62-bit digest of what a call computes: the plan's segments (tokens, parent, trained tokens), its budget and
    step count, and ``settings`` (temperature, entropy, ...; their ``repr``)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(repr((plan.max_tokens, len(plan.steps), settings)).encode())
    for s in plan.tree.segments:
        h.update(repr((s.parent, s.start, s.group, s.completion)).encode())
        h.update(s.tokens.cpu().numpy().tobytes())
        if s.computed is not None:
            h.update(s.computed.cpu().numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 2


def agree(group, error: BaseException | None, key: int | None) -> BaseException | None:
    """The error this rank must raise (see the module docstring), or None: its own ``error``; one naming the first
    rank of ``group`` that failed; or a ValueError when the ranks' digests ``key`` differ. One small all-gather."""
    size = dist.get_world_size(group)
    mine = torch.tensor(
        [0 if error is None else 1, 0 if key is None else key], dtype=torch.int64, device=comm_device(group)
    )
    got = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(got, mine, group=group)
    flags, keys = [int(t[0]) for t in got], [int(t[1]) for t in got]
    if any(flags):
        msgs: list = [None] * size
        dist.all_gather_object(msgs, None if error is None else f"{type(error).__name__}: {error}", group=group)
        if error is not None:
            return error
        r = flags.index(1)
        return RuntimeError(
            f"rank {r} of the sequence group stopped before any computation of this sharedprefix call ({msgs[r]}); "
            "every rank of the group stops with it instead of waiting in an exchange that rank would never join."
        )
    if len(set(keys)) > 1:
        differ = [r for r in range(size) if keys[r] != keys[0]]
        return ValueError(
            f"the {size} ranks of sequence_group passed different inputs: rank(s) {differ} would compute other rows "
            "(groups, token ids, trained tokens, max_tokens, temperature, entropy or prefix_activations) than rank 0 "
            "(group rank). The ranks of a sequence group compute one row together, so each must pass the same "
            "arguments; split the data over the data-parallel ranks instead (the other dimension of the mesh)."
        )
    return None


def check_group(pg):
    """``pg`` as a sequence group: a torch.distributed process group of this process, or None (no sequence
    parallelism). Returns it, or None for a group of one rank (nothing to split)."""
    if pg is None:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "sequence_group was given but torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first (every rank of the group passes the same groups)."
        )
    if not isinstance(pg, dist.ProcessGroup):
        raise TypeError(
            f"sequence_group is a {type(pg).__name__}; expected a torch.distributed.ProcessGroup (e.g. from "
            "torch.distributed.new_group(ranks) or a DeviceMesh's get_group()) or None."
        )
    if dist.get_rank(pg) < 0:
        raise ValueError("sequence_group does not contain this process; pass the group this rank belongs to.")
    return pg if dist.get_world_size(pg) > 1 else None


def refuse_hybrid(name: str, group) -> None:
    """Hybrid models stay on one rank per row: refused under sequence parallelism, with the reason."""
    if group is not None:
        raise ValueError(
            f"{name} is a hybrid model (recurrent, SSM or convolution layers beside attention) and sequence_group "
            "has several ranks: those layers scan the row token after token, so a rank holding a slice of the row "
            "would need the state of the slices before it, which sharedprefix's hybrid path does not pass between "
            "ranks. Use sequence_group=None for this model."
        )


def refuse_aux(name: str) -> None:
    """The MoE load-balancing loss under sequence parallelism: refused, with the reason."""
    raise ValueError(
        f"{name} returns its MoE load-balancing loss (output_router_logits, or aux_loss / "
        "aux_loss_coef given) and a sequence_group was passed: under sequence parallelism each rank routes only its "
        "shard of the row's tokens, and sharedprefix does not gather the router logits across the group, so the "
        "loss would not be the plain run's. Pass aux_loss=False / aux_loss_coef=0.0 (routing itself stays exact), "
        "or drop sequence_group."
    )


def refuse_features(name: str, features: dict) -> None:
    """Refuse, under sequence parallelism, what the split does not reproduce; ``features``: {what: reason} of the
    ones the call uses (the executor finds them)."""
    if features:
        what, why = next(iter(features.items()))
        raise ValueError(
            f"{name} with {what} and a sequence_group of several ranks: {why}, which Ulysses sequence parallelism "
            "(a slice of the row per rank outside attention) does not reproduce. Use sequence_group=None here."
        )


def check_heads(name: str, num_heads: int, num_kv_heads: int, size: int) -> None:
    """Refuse head counts the exchange cannot split evenly."""
    if num_heads % size:
        raise ValueError(
            f"{name} has {num_heads} query heads, not a multiple of the sequence group's {size} ranks: Ulysses "
            "sequence parallelism gives each rank H/S query heads. Use a sequence group whose size divides "
            f"{num_heads}."
        )
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(
            f"{name} has {num_kv_heads} key/value heads and the sequence group {size} ranks: each rank needs "
            "Hkv/S whole key/value heads, or (Hkv < S) one head replicated S/Hkv times, so one must divide the "
            "other. Use a sequence group size that divides or is a multiple of the key/value heads."
        )


@dataclass
class SequenceShard:
    """One pass's row split over the sequence group: ``length`` L tokens, ``local`` Ls of them per rank."""

    group: object
    length: int

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def local(self) -> int:
        return -(-self.length // self.size)

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """(..., L) -> (..., Ls): this rank's tokens of a per-token tensor (ids, positions), padded with zeros."""
        pad = self.local * self.size - t.shape[-1]
        if pad:
            t = F.pad(t, (0, pad))
        return t[..., self.rank * self.local : (self.rank + 1) * self.local]

    def gather(self, hidden: torch.Tensor) -> torch.Tensor:
        """(Ls, d) final hidden states of this rank -> (L, d), the whole row's, on every rank."""
        return _Gather.apply(hidden, self.group)[: self.length]

    def to_heads(self, name: str, query, key, value, sinks):
        """(1, H, Ls, D) query and (1, Hkv, Ls, D) key / value shards -> the whole row's first L tokens for this
        rank's heads: (1, H/S, L, D) and (1, max(Hkv/S, 1), L, D); sinks (H,) -> (H/S,)."""
        size = self.size
        h, hkv = query.shape[1], key.shape[1]
        check_heads(name, h, hkv, size)
        if hkv < size:  # each key/value head replicated, in order, so that rank r gets head r // (S / Hkv)
            key = key.repeat_interleave(size // hkv, dim=1)
            value = value.repeat_interleave(size // hkv, dim=1)
        q, k, v = (_AllToAll.apply(t, self.group, 1, 2)[:, :, : self.length] for t in (query, key, value))
        if sinks is not None:
            sinks = sinks[self.rank * (h // size) : (self.rank + 1) * (h // size)]
        return q, k, v, sinks

    def from_heads(self, out: torch.Tensor) -> torch.Tensor:
        """(1, L, H/S, Dv) attention output of this rank's heads -> (1, Ls, H, Dv), this rank's tokens."""
        pad = self.local * self.size - self.length
        if pad:
            out = F.pad(out, (0, 0, 0, 0, 0, pad))
        return _AllToAll.apply(out, self.group, 1, 2)


def fsdp_mesh_refusal(root, group) -> str | None:
    """Why FSDP2 on ``root`` cannot sum the gradients over the sequence group ``group`` (None: it can). FSDP2's
    reduce-scatter averages over its mesh; with every rank of the group in that mesh, each rank's 1/S share is
    summed there (the losses scaled by the mesh size as without sequence parallelism)."""
    mesh = getattr(getattr(root._get_fsdp_state(), "_fsdp_param_group", None), "mesh_info", None)
    mesh = getattr(mesh, "mesh", None)
    if mesh is None:
        return "its root has no parameter group of its own, whose mesh sharedprefix reads"
    ranks = set(mesh.mesh.flatten().tolist())
    missing = sorted(set(dist.get_process_group_ranks(group)) - ranks)
    if missing or len(ranks) != dist.get_world_size():
        return (
            f"its mesh holds ranks {sorted(ranks)} of {dist.get_world_size()}, and the gradient of a sequence-parallel "
            "call is summed over the group by FSDP2's reduce-scatter, which needs a mesh over every rank (verl's "
            "FSDP2 mesh is)"
        )
    return None


def reduce_grads(model: torch.nn.Module, group) -> None:
    """Sum every gradient over ``group`` (a sequence group; None: every rank, DDP), one all-reduce per dtype and
    device; a parameter without a gradient gets zeros first, so that every rank joins the same all-reduces."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_kind: dict = {}
    for p in params:
        by_kind.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in by_kind.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        off = 0
        for g in grads:
            g.copy_(flat[off : off + g.numel()].view_as(g))
            off += g.numel()
