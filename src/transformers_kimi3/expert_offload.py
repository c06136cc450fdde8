"""Expert offloading: the routed experts in host memory, a per-layer cache of them on the device.

`offload_experts(model, device, resident_experts=...)` moves everything except the routed experts to `device`
(embeddings, attention, routers, shared experts, latent projections, norms, the head) and keeps every
routed-experts module's weights (`PackedMXFP4Experts`' packed bytes and scales, or `Kimi3Experts`' float w1 / w3 /
w2) in host memory, pinned when `device` is CUDA. Each MoE layer gets an `ExpertCache`: `resident_experts` expert
slots on `device`. At every forward of the layer (`Kimi3SparseMoeBlock.forward` calls `ExpertCache.fetch` right
after its router):

1. the step's experts are the unique ids the router chose (one host synchronisation: the ids are read on the host);
2. hits use their slot; misses are copied host -> device into slots freed by evicting the least recently used
   experts that this step does not need;
3. the layer's own experts module computes on a view of the slots (the same class, `num_experts` = the slot
   count) with every route's expert id replaced by its slot. The module's paths and arithmetic are unchanged, so
   each route is computed from the same weights, with the same rows per expert, in the same order: on the exact
   paths (fp32, and every CPU path) the logits equal the all-on-device model's bit for bit.

A step that needs more experts than there are slots (a long prefill) gets a temporary buffer holding all of its
experts for that layer (the resident hits copied device -> device, the misses from the host) and runs them in one
call, which keeps it exact; afterwards the cache keeps its hits and fills the slots it can free with the misses
that had the most routes. Splitting such a step into groups of experts that fit would need the per-route outputs
before the weighted sum (the sum over a token's routes must run in one order to stay exact), which the experts'
fused paths do not expose: growth costs that layer's step's experts in device memory for the step, at most all of
one layer's experts.

Eviction is least recently used (a step counter per layer, ties to the lower slot): exact whatever the policy, no
parameter to tune, and it follows a shift in which experts a prompt uses, where counting routes since the start
would keep the experts a long prefill favoured. An expert the current step needs is never evicted.

On CUDA the copies run on a copy stream of their own: a layer's copies are issued as soon as its router's ids have
reached the host, before its latent down-projection and shared experts are enqueued on the compute stream, so the
transfers overlap those two; the routed experts wait for the copies (a CUDA event) and nothing else does. The next
layer's attention cannot overlap: which experts it needs is known only after its router, which follows it. The
host read of the ids cannot be captured in a CUDA graph: `offload_experts` sets `decode_cuda_graph = False`
(static-cache decode steps run eagerly) and a capture that reaches an offloaded layer is refused. With
host_device == device ("cpu", what CI tests) the same code path runs with plain copies.

Inference only: the weights are frozen (float experts' parameters get requires_grad=False); gradients still flow to
the activations and routing weights. `model.state_dict()` / `save_pretrained` read the host copies.
"""

import contextlib
import copy

import torch
from torch import nn

from .moe import Kimi3Experts, Kimi3SparseMoeBlock
from .mxfp4_experts import PackedMXFP4Experts

_TENSORS = {PackedMXFP4Experts: ("w1_packed", "w1_scale", "w3_packed", "w3_scale", "w2_packed", "w2_scale"),
            Kimi3Experts: ("w1", "w3", "w2")}


class _Fetched:
    """The experts module one step computes with: waits for the step's copies, then runs the slot view with every
    route's expert id replaced by its slot."""

    def __init__(self, view, lut, event):
        self.view, self.lut, self.event = view, lut, event

    def __call__(self, x, topk_idx, topk_weights):
        if self.event is not None:
            torch.cuda.current_stream(x.device).wait_event(self.event)
        return self.view(x, self.lut[topk_idx], topk_weights)


class ExpertCache:
    """One MoE layer's routed experts: all of them on the host (the experts module's own tensors) and
    `resident_experts` slots on the device, least recently used evicted (module docstring)."""

    def __init__(self, name, experts, device, resident_experts, copy_stream=None):
        self.name, self.experts, self.device = name, experts, device
        self.num_experts, self.num_slots = experts.num_experts, resident_experts
        self.names = _TENSORS[type(experts)]
        self.host = {n: getattr(experts, n).detach() for n in self.names}
        self.slots = {n: torch.empty((resident_experts,) + t.shape[1:], dtype=t.dtype, device=device)
                      for n, t in self.host.items()}
        self.expert_bytes = sum(t[0].numel() * t.element_size() for t in self.host.values())
        self.view = self._view(self.slots, resident_experts)
        self.copy_stream = copy_stream
        self.expert_of = [-1] * resident_experts  # slot -> expert (-1: empty)
        self.slot_of = {}  # expert -> slot
        self.last_used = [-1] * resident_experts  # slot -> step of its last use
        self.step = 0
        self.lut = None  # expert -> slot on the device (num_slots: not resident; one entry more for off-rank ids)
        self.reset_stats()

    def reset_stats(self):
        self.hits = self.misses = self.bytes_copied = self.overflow_steps = 0

    def stats(self):
        """Counts since the last reset: steps (forwards of the layer), hits / misses (unique experts per step, hit:
        already resident), bytes_copied (host -> device), overflow_steps (steps that needed more experts than slots),
        and the experts resident now."""
        return dict(layer=self.name, steps=self.step, hits=self.hits, misses=self.misses,
                    bytes_copied=self.bytes_copied, overflow_steps=self.overflow_steps,
                    resident=sorted(e for e in self.expert_of if e >= 0))

    def _view(self, tensors, n):
        """The experts module over `tensors` (n experts): the same class and settings, unregistered."""
        view = copy.copy(self.experts)
        view._parameters, view._buffers, view._modules = {}, {}, dict(self.experts._modules)
        view._non_persistent_buffers_set = set()
        for name, t in tensors.items():
            if isinstance(self.experts, Kimi3Experts):
                view._parameters[name] = nn.Parameter(t, requires_grad=False)
            else:
                view._buffers[name] = t
        view.num_experts = n
        if isinstance(view, PackedMXFP4Experts):
            view._tiles, view._table_free_key = {}, None
        return view

    def _copy(self, dst, dst_slot, src, src_index):
        for n in self.names:
            dst[n][dst_slot].copy_(src[n][src_index], non_blocking=True)

    def fetch(self, topk_idx):
        """The step's experts on the device (copies issued, on the copy stream on CUDA); returns the callable that
        computes the routed experts of this step: (x, topk_idx, topk_weights) -> as the experts module."""
        if topk_idx.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("offloaded experts read the router's choice on the host, which a CUDA graph cannot "
                               "capture: decode without CUDA graphs (a static cache's graphs, torch.compile's "
                               "cudagraphs) on a model with offloaded experts")
        ids, counts = torch.unique(topk_idx, return_counts=True)
        step = [(e, c) for e, c in zip(ids.tolist(), counts.tolist()) if e < self.num_experts]  # E: off-rank routes
        need = {e for e, _ in step}
        hits = [e for e, _ in step if e in self.slot_of]
        misses = [e for e, _ in step if e not in self.slot_of]
        self.step += 1
        self.hits += len(hits)
        self.misses += len(misses)
        self.bytes_copied += len(misses) * self.expert_bytes
        free = sorted((s for s in range(self.num_slots) if self.expert_of[s] not in need),
                      key=lambda s: (self.last_used[s], s))  # least recently used first
        overflow = len(step) > self.num_slots
        if overflow:  # more experts than slots: all of them in a temporary buffer, exact in one call
            self.overflow_steps += 1
            # allocated on the compute stream, which frees it after the experts have read it
            tmp = {k: torch.empty((len(step),) + t.shape[1:], dtype=t.dtype, device=self.device)
                   for k, t in self.slots.items()}
        stream = self.copy_stream
        if stream is not None and (misses or overflow):
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            changed = {}  # expert -> its new slot (num_slots: evicted), for the resident lookup table
            if not overflow:
                view = self.view
                for e, s in zip(misses, free):
                    changed.update(self._admit(e, s))
                    self._copy(self.slots, s, self.host, e)
            else:
                n = len(step)
                pos = {e: i for i, (e, _) in enumerate(step)}
                for e in hits:
                    self._copy(tmp, pos[e], self.slots, self.slot_of[e])
                for e in misses:
                    self._copy(tmp, pos[e], self.host, e)
                # the cache keeps its hits and takes the misses with the most routes into the slots it can free
                ranked = sorted(((c, -e) for e, c in step if e not in self.slot_of), reverse=True)
                for (_, neg), s in zip(ranked, free):
                    changed.update(self._admit(-neg, s))
                    self._copy(self.slots, s, tmp, pos[-neg])
                view = self._view(tmp, n)
            for e in hits:
                self.last_used[self.slot_of[e]] = self.step
            event = stream.record_event() if stream is not None and (misses or overflow) else None
        lut = self._resident_lut(changed, topk_idx)  # on the compute stream, in order with the steps that read it
        if overflow:  # this step's own table: its experts' positions in the temporary buffer
            lut = [pos.get(e, n) for e in range(self.num_experts)]
            lut = torch.tensor(lut + [n], dtype=topk_idx.dtype, device=topk_idx.device)
        return _Fetched(view, lut, event)

    def _resident_lut(self, changed, topk_idx):
        """The lookup table of the resident slots, kept on the device and changed only where experts came or went
        (building it whole each step would cost the host a loop over every expert of every layer)."""
        if self.lut is None or self.lut.dtype != topk_idx.dtype:
            self.lut = torch.full((self.num_experts + 1,), self.num_slots, dtype=topk_idx.dtype,
                                  device=topk_idx.device)
            changed = dict(self.slot_of)
        if changed:
            ids, slots = zip(*changed.items())
            self.lut[list(ids)] = torch.tensor(slots, dtype=self.lut.dtype, device=self.lut.device)
        return self.lut

    def _admit(self, e, s):
        """Expert e into slot s (its occupant evicted); returns {expert: new slot} of the experts whose slot changed
        (num_slots for the evicted one)."""
        old, changed = self.expert_of[s], {e: s}
        if old >= 0:
            del self.slot_of[old]
            changed[old] = self.num_slots
        self.expert_of[s], self.slot_of[e], self.last_used[s] = e, s, self.step
        return changed


class ExpertOffload:
    """What `offload_experts` returns (also `model.expert_offload`): the per-layer caches by module name."""

    def __init__(self, caches, device, host_device, pinned):
        self.caches, self.device, self.host_device, self.pinned = caches, device, host_device, pinned

    def stats(self):
        """Per MoE layer, in layer order: `ExpertCache.stats()` (hits, misses, bytes copied host -> device, ...)."""
        return [c.stats() for c in self.caches.values()]

    def reset_stats(self):
        for c in self.caches.values():
            c.reset_stats()

    def __repr__(self):
        c = next(iter(self.caches.values()))
        return (f"ExpertOffload({len(self.caches)} MoE layers, {c.num_slots} of {c.num_experts} experts resident "
                f"on {self.device}, the rest on {self.host_device}{' (pinned)' if self.pinned else ''})")


def _to(t, device, pin):
    t = t.detach().to(device)
    return t.pin_memory() if pin and not t.is_pinned() else t


def offload_experts(model, device, resident_experts, host_device="cpu", pin_memory=None):
    """Keep `model`'s routed experts on `host_device` and a cache of `resident_experts` of them per MoE layer on
    `device`, with everything else moved to `device` (module docstring). Apply it to a loaded model whose weights
    are on one device (no `device_map`); don't move the model afterwards. `pin_memory` (default: when `device` is
    CUDA and the host is the CPU) pins the host copies, which asynchronous copies need. Returns an `ExpertOffload`
    (`.stats()`: per-layer hits, misses, bytes copied), also kept as `model.expert_offload`."""
    device, host_device = torch.device(device), torch.device(host_device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if getattr(model, "expert_offload", None) is not None:
        raise ValueError("the model's experts are offloaded already (model.expert_offload)")
    if any(hasattr(m, "_hf_hook") for m in model.modules()):
        raise ValueError("offload_experts needs a model on one device: load it without device_map (Accelerate's "
                         "hooks move weights themselves)")
    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, Kimi3SparseMoeBlock)]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no routed experts (no Kimi3SparseMoeBlock): nothing to offload")
    for name, block in blocks:
        if type(block.experts) not in _TENSORS:
            raise TypeError(f"{name}.experts is {type(block.experts).__name__}: offloading runs Kimi3Experts and "
                            "PackedMXFP4Experts (merge LoRA adapters, export QAT weights first)")
    num_experts = blocks[0][1].experts.num_experts
    if isinstance(resident_experts, bool) or not isinstance(resident_experts, int) \
            or not 1 <= resident_experts <= num_experts:
        raise ValueError(f"resident_experts must be an integer in [1, {num_experts}] (the experts of a layer), got "
                         f"{resident_experts!r}")
    pin = (device.type == "cuda" and host_device.type == "cpu") if pin_memory is None else bool(pin_memory)
    experts = {id(b.experts) for _, b in blocks}
    for module in model.modules():  # everything but the routed experts to the device
        if id(module) in experts:
            continue
        for p in module._parameters.values():
            if p is not None and p.device != device:
                p.data = p.data.to(device)
        for n, b in module._buffers.items():
            if b is not None and b.device != device:
                module._buffers[n] = b.to(device)
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    caches = {}
    for name, block in blocks:
        mod = block.experts
        for n in _TENSORS[type(mod)]:
            if n in mod._parameters:
                mod._parameters[n] = nn.Parameter(_to(mod._parameters[n], host_device, pin), requires_grad=False)
            else:
                mod._buffers[n] = _to(mod._buffers[n], host_device, pin)
        cache = ExpertCache(f"{name}.experts", mod, device, resident_experts, stream)
        block.expert_cache = cache
        caches[name] = cache
    for m in model.modules():  # decode steps run eagerly: a CUDA graph cannot replay the host's choice of copies
        if hasattr(m, "decode_cuda_graph"):
            m.decode_cuda_graph = False
    model.expert_offload = ExpertOffload(caches, device, host_device, pin)
    return model.expert_offload


__all__ = ["offload_experts", "ExpertOffload", "ExpertCache"]
