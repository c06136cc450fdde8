"""Context parallel: one sequence split along its length in contiguous pieces over the ranks of a process group, so
that a sequence too long for one device's activation memory can be prefilled or trained. Every rank holds the whole
model (or its FSDP2 shards) and the same piece of every row; logits, loss and gradients are those of one process
on the whole sequence.

    with context_parallel(model, group):                 # rank r of the group holds the r-th piece
        batch = shard_sequence(input_ids, labels, group)  # this rank's input_ids and shift_labels
        loss = model(**batch).loss                        # the mean over the whole sequence, on every rank
        loss.backward()                                   # on every rank; then average the gradients over the group

What crosses ranks (`Pieces`, made once per forward by the model):
- Per-token parts (embedding, AttnRes mixes, norms, projections, dense MLP, MoE, head): nothing.
- MLA (NoPE: positions play no part): the compressed latents, `kv_lora_rank + qk_rope_head_dim` values per token,
  are all-gathered; each rank attends its queries to the keys of positions 0 .. the end of its piece, causal with
  its offset. The backward sums each latent's gradients back to the rank that owns it (reduce-scatter).
- KDA is a recurrence: rank r receives from rank r-1 the state after r-1's piece (per head K x V, fp32) and the last
  `conv_kernel_size - 1` pre-conv q/k/v inputs (the convs' halo), runs its piece from them and sends its own to
  r+1; the backward sends their gradients from r to r-1. So the ranks run a KDA layer one after another: what is
  split is the memory (each rank holds its own piece's activations) and the per-token work, not the recurrence's
  time. (Each rank computes its projections before it waits.)
- The loss: labels are shifted on the whole sequence before splitting (`shard_sequence`), each rank sums the cross
  entropy of its tokens, and the sums and counts are all-reduced. The backward of that all-reduce gives every rank
  its tokens' gradients times the group size: averaging the gradients over the group, as FSDP2 (`apply_fsdp2`) and
  DDP do, gives one process's gradients exactly.

Nothing is kept outside the model: `context_parallel` gives the model's `Kimi3Model` the group for the duration of
the `with` block and takes it back on exit. Nothing here names a device.
"""

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["context_parallel", "shard_sequence"]

IGNORE_INDEX = -100


def _group(group):
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("context parallel needs an initialised process group (torch.distributed."
                         "init_process_group(), e.g. under torchrun)")
    return dist.group.WORLD if group is None else group


@contextlib.contextmanager
def context_parallel(model, group=None):
    """Inside the `with` block, every forward of `model` computes this rank's piece of one sequence split over
    `group` (None: the default process group), rank order = sequence order. Pieces may differ in length (by any
    amount; each holds at least one token). Yields the `ContextParallel` the model computes with.

    model: a Kimi3 / KimiLinear model (`Kimi3ForCausalLM`, `Kimi3ForConditionalGeneration` without images,
        `Kimi3Model`), also wrapped by PEFT or sharded by `apply_fsdp2` (on the same or other ranks).
    In a forward, refused with an error naming the argument: an `attention_mask` with padding (an all-ones one is
    accepted), `past_key_values` or `use_cache=True`, packed documents (`position_ids` restarting, `cu_seq_lens_q`),
    `output_attentions`, `labels` (pass `shift_labels`, which `shard_sequence` makes), `logits_to_keep`, and
    `pixel_values`. Every rank must run every forward and backward (they communicate)."""
    group = _group(group)
    bases = [m for m in model.modules() if getattr(type(m), "_context_parallel", False) is None]  # Kimi3Model
    if not bases:
        raise ValueError(f"model ({type(model).__name__}) holds no Kimi3Model: context_parallel splits the sequences "
                         "of Kimi3 / KimiLinear models and of PEFT or FSDP2 models built on them")
    if any(m._context_parallel is not None for m in bases):
        raise ValueError("model is already inside a context_parallel block")
    state = ContextParallel(group)
    for m in bases:
        m._context_parallel = state
    try:
        yield state
    finally:
        for m in bases:
            del m._context_parallel  # the class's None again


def shard_sequence(input_ids, labels=None, group=None):
    """This rank's piece of a batch whose rows are split along their length over `group`: the model's keyword
    arguments `{"input_ids": ..., "shift_labels": ...}`. input_ids, labels [B, T] (the whole sequence, the same on
    every rank); the labels are shifted on the whole sequence first (position t's target is label t+1; the last
    position gets -100), so the last token of rank r predicts the first of rank r+1. Pieces are contiguous, rank
    order; the first T % world ranks get one token more (`torch.tensor_split`)."""
    group = _group(group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if input_ids.dim() < 2 or input_ids.shape[1] < world:
        raise ValueError(f"input_ids of shape {list(input_ids.shape)}: context parallel splits dim 1 and needs at "
                         f"least one token per rank ({world} ranks)")
    batch = {"input_ids": torch.tensor_split(input_ids, world, dim=1)[rank]}
    if labels is not None:
        if labels.shape != input_ids.shape[:2]:
            raise ValueError(f"labels have shape {list(labels.shape)}, input_ids {list(input_ids.shape)}")
        shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        batch["shift_labels"] = torch.tensor_split(shifted, world, dim=1)[rank]
    return batch


class ContextParallel:
    """The group a model computes over inside `context_parallel`. The model asks it for each forward's `Pieces`
    (`pieces`) and for the loss (`loss`)."""

    def __init__(self, group):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def pieces(self, inputs_embeds, **refused):
        """Every rank's piece length (an all-gather): the forward's `Pieces`. refused: name -> whether this rank's
        forward was given that unsupported argument. A refusal on any rank is an error on every rank (no rank is
        left waiting in a collective)."""
        B, T = inputs_embeds.shape[:2]
        names = sorted(refused)
        mine = torch.tensor([B, T] + [bool(refused[n]) for n in names], device=inputs_embeds.device)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.group)
        every = [t.tolist() for t in every]
        bad = sorted({n for row in every for n, flag in zip(names, row[2:]) if flag})
        if bad:
            raise ValueError("; ".join(f"{n}: not supported under context parallel ({_REFUSED[n]})" for n in bad))
        if len({row[0] for row in every}) > 1:
            raise ValueError(f"input_ids: the ranks hold {[row[0] for row in every]} rows; context parallel splits "
                             "the same rows along their length on every rank")
        return Pieces(self.group, self.rank, [row[1] for row in every])

    def loss(self, logits, shift_labels, num_items_in_batch=None, ignore_index=IGNORE_INDEX):
        """The mean cross entropy over every rank's tokens, the same value on every rank: this rank's sum over its
        logits [B, T_r, V] and its piece of the shifted labels [B, T_r], all-reduced, divided by the number of
        labelled tokens of all ranks (or by num_items_in_batch)."""
        if shift_labels.shape != logits.shape[:2]:
            raise ValueError(f"shift_labels have shape {list(shift_labels.shape)}; this rank's logits cover "
                             f"{list(logits.shape[:2])} positions")
        shift_labels = shift_labels.to(logits.device)
        local = F.cross_entropy(logits.float().flatten(0, 1), shift_labels.flatten(), ignore_index=ignore_index,
                                reduction="sum")
        total = _SumOverRanks.apply(local, self.group)
        if num_items_in_batch is not None:
            return total / num_items_in_batch
        count = (shift_labels != ignore_index).sum()
        dist.all_reduce(count, group=self.group)
        return total / count


_REFUSED = {
    "attention_mask": "padding; every position must be a token",
    "past_key_values": "no cache: it is for prefill and training",
    "use_cache": "no cache: it is for prefill and training",
    "position_ids": "packed documents (position_ids restarting or cu_seq_lens_q)",
    "output_attentions": "attention maps",
}


class Pieces:
    """One forward's split: this rank's piece is positions offset .. offset + sizes[rank] of every row."""

    def __init__(self, group, rank, sizes):
        self.group, self.rank, self.sizes = group, rank, list(sizes)
        self.offset = sum(self.sizes[:rank])
        self.first, self.last = rank == 0, rank == len(self.sizes) - 1

    def _peer(self, rank):
        return dist.get_global_rank(self.group, rank) if self.group is not dist.group.WORLD else rank

    def gather_keys(self, x):
        """MLA: x [B, T_r, C] (this rank's latents) -> [B, offset + T_r, C], the latents of positions 0 .. the end
        of this piece. All ranks' pieces are gathered (padded to the longest); the backward sums each piece's
        gradients back to its rank."""
        pad = max(self.sizes) - x.shape[1]
        every = _AllGather.apply(F.pad(x, (0, 0, 0, pad)), self.group, self.rank)
        return torch.cat([p[:, :n] for p, n in zip(every, self.sizes[:self.rank + 1])], dim=1)

    def receive(self, shapes, like, tracked):
        """KDA: the tensors the previous rank sent (`send`), fp32, of these shapes, on `like`'s device; None on the
        first rank. tracked: the tensors whose gradients decide whether the message has one (`_anchor`); if so, the
        backward sends the message's gradient back to the previous rank."""
        if self.first:
            return None
        numels = [math.prod(s) for s in shapes]
        anchor, peer = _anchor(tracked), self._peer(self.rank - 1)
        if anchor is None:
            flat = like.new_empty(sum(numels), dtype=torch.float32)
            dist.recv(flat, peer, group=self.group)
        else:
            flat = _Recv.apply(anchor, like.device, sum(numels), peer, self.group)
        return [t.view(s) for t, s in zip(flat.split(numels), shapes)]

    def send(self, carrier, tensors, tracked):
        """KDA: send `tensors` (one fp32 message) to the next rank; returns `carrier` (a tensor the loss depends on
        whenever the message has a gradient), through which the backward receives the message's gradient. The
        last rank sends nothing."""
        if self.last:
            return carrier
        flat = torch.cat([t.float().flatten() for t in tensors])
        peer = self._peer(self.rank + 1)
        if _anchor(tracked) is None:
            dist.send(flat.detach(), peer, group=self.group)
            return carrier
        return _Send.apply(carrier, flat, peer, self.group)


def _anchor(tracked):
    """The first of `tracked` that requires a gradient while autograd records, else None. A KDA layer passes the
    tensors its message (final state, conv halo) depends on, besides the previous rank's message: its q/k/v
    inputs, gates, beta, A_log, dt_bias, k/v conv weights. They are alike on every rank, so sender and receiver
    agree on whether the message's gradient travels back (a rank waiting for one that never comes would hang)."""
    if not torch.is_grad_enabled():
        return None
    return next((t for t in tracked if t.requires_grad), None)


class _Send(torch.autograd.Function):
    """Forward: send `message` to `peer`, return `carrier` unchanged. Backward: receive the message's gradient."""

    @staticmethod
    def forward(ctx, carrier, message, peer, group):
        dist.send(message.detach().contiguous(), peer, group=group)
        ctx.peer, ctx.group, ctx.numel = peer, group, message.numel()
        return carrier.view_as(carrier)

    @staticmethod
    def backward(ctx, grad):
        grad_message = grad.new_empty(ctx.numel, dtype=torch.float32)
        dist.recv(grad_message, ctx.peer, group=ctx.group)
        return grad, grad_message, None, None


class _Recv(torch.autograd.Function):
    """Forward: receive a fp32 message of `numel` values from `peer` onto `device` (`anchor` only ties it into the
    graph). Backward: send its gradient back."""

    @staticmethod
    def forward(ctx, anchor, device, numel, peer, group):
        message = torch.empty(numel, dtype=torch.float32, device=device)
        dist.recv(message, peer, group=group)
        ctx.peer, ctx.group = peer, group
        return message

    @staticmethod
    def backward(ctx, grad):
        dist.send(grad.contiguous(), ctx.peer, group=ctx.group)
        return None, None, None, None, None


class _AllGather(torch.autograd.Function):
    """Forward: every rank's x, in rank order. Backward: each rank's piece gets the sum of all ranks' gradients
    for it (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, rank):
        x = x.contiguous()
        every = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, x, group=group)
        ctx.group, ctx.rank = group, rank
        return tuple(every)

    @staticmethod
    def backward(ctx, *grads):
        mine = torch.empty_like(grads[ctx.rank])
        dist.reduce_scatter(mine, [g.contiguous() for g in grads], group=ctx.group)
        return mine, None, None


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum). Its backward all-reduces the output gradients: with the loss backpropagated on every rank,
    each rank's input gets the group size times d loss / d input."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
