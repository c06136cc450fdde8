"""The hybrid cache: per KDA layer the short-conv inputs and the fp32 recurrent state, per MLA layer the
compressed latent (normalised c_kv | k_pe, 576 values per token for K3) and nothing else."""

import contextlib

import torch
from transformers.cache_utils import Cache


class Kimi3Cache(Cache):
    """Decode state of a Kimi3 / Kimi Linear stack.

    KDA layer l: `conv_states[l]` = (q, k, v) tensors [B, D, W] holding the last W conv inputs (W = kernel size;
    the official code keeps W too), `recurrent_states[l]` [B, H, K, V] float32.
    MLA layer l: `latents[l]` [B, T_seen, kv_lora_rank + qk_rope_head_dim].
    `seen_tokens` counts every position fed so far, padding included (it is the length of the 2-D mask).

    Static mode (`max_length` given, `generate(..., cache_implementation="static")`): latents live in buffers of
    `max_length` positions and every state is updated in place, so a decode step has fixed shapes and fixed
    addresses. Inside `addressed_by(position)` the write position is a device tensor instead of `seen_tokens`, so
    one recorded decode step (a CUDA graph, see generation.py) serves every position. `storage_version` changes
    whenever a state tensor is replaced rather than written in place: whatever holds the old addresses is stale.
    """

    is_compileable = False

    def __init__(self, config, max_length=None, **kwargs):
        super().__init__(layers=[])
        self.max_length = max_length
        self.layer_types = list(config.layer_types)
        n = len(self.layer_types)
        self.conv_states = [None] * n
        self.recurrent_states = [None] * n
        self.latents = [None] * n
        self.seen_tokens = 0
        self.source_tokens = 0  # input ids consumed (an image placeholder counts once)
        self.attention_mask = None  # 2-D padding mask over the seen positions, None while there is no padding
        self.position = None  # inside addressed_by(): the write position as a device tensor [1]
        self.storage_version = 0

    def __len__(self):
        return len(self.layer_types)

    @contextlib.contextmanager
    def addressed_by(self, position):
        """Static mode: within this block the new token is written at the device tensor `position` [1] and MLA
        reads the whole `max_length` buffer under `position_mask()`, so the step contains no Python integer that a
        recording would freeze."""
        if self.max_length is None:
            raise ValueError("Only a static cache (max_length given) can be addressed by a device position")
        self.position = position
        try:
            yield self
        finally:
            self.position = None

    def position_mask(self, device):
        """Inside addressed_by(): the static latent positions a decode query may attend, [1,1,1,max_length]."""
        return (torch.arange(self.max_length, device=device) <= self.position).view(1, 1, 1, -1)

    # --- MLA
    def update_latent(self, latent, layer_idx):
        old = self.latents[layer_idx]
        if self.max_length is None:
            self.latents[layer_idx] = latent if old is None else torch.cat([old, latent.to(old.device)], dim=1)
            self.storage_version += 1
            return self.latents[layer_idx]
        B, T, width = latent.shape
        if old is None:
            old = self.latents[layer_idx] = latent.new_zeros(B, self.max_length, width)
            self.storage_version += 1
        if self.position is not None:
            old.index_copy_(1, self.position, latent)
            return old
        if self.seen_tokens + T > self.max_length:
            raise ValueError(f"The static cache holds {self.max_length} positions; {self.seen_tokens} are used and "
                             f"this call adds {T}")
        old[:, self.seen_tokens:self.seen_tokens + T] = latent
        return old[:, :self.seen_tokens + T]

    # --- KDA: in place once a state exists, so whatever recorded the addresses keeps reading the same memory
    def update_kda_state(self, layer_idx, conv_states, recurrent_state):
        old_conv, old_rec = self.conv_states[layer_idx], self.recurrent_states[layer_idx]
        if old_conv is None or old_conv[0].shape != conv_states[0].shape:
            self.conv_states[layer_idx] = tuple(conv_states)
            self.storage_version += 1
        else:
            for o, n in zip(old_conv, conv_states):
                o.copy_(n)
        if old_rec is None or old_rec.shape != recurrent_state.shape:
            self.recurrent_states[layer_idx] = recurrent_state
            self.storage_version += 1
        elif old_rec is not recurrent_state:
            old_rec.copy_(recurrent_state)

    def snapshot(self):
        return [(None if c is None else tuple(t.clone() for t in c), None if r is None else r.clone(),
                 None if lat is None else lat.clone())
                for c, r, lat in zip(self.conv_states, self.recurrent_states, self.latents)]

    def restore(self, snap):
        """Copy a snapshot back in place (the tensors keep their addresses)."""
        for i, (c, r, lat) in enumerate(snap):
            if c is not None:
                for o, n in zip(self.conv_states[i], c):
                    o.copy_(n)
            if r is not None:
                self.recurrent_states[i].copy_(r)
            if lat is not None:
                self.latents[i].copy_(lat)

    # --- Transformers' Cache interface
    def get_seq_length(self, layer_idx=0):
        return self.seen_tokens

    def get_mask_sizes(self, query_length, layer_idx=0):
        return self.seen_tokens + query_length, 0

    def get_max_length(self, layer_idx=None):
        return -1

    def has_previous_state(self, layer_idx=None, state_idx=None):
        return self.seen_tokens > 0

    @property
    def is_initialized(self):
        return self.seen_tokens > 0

    @property
    def is_sliding(self):
        return [False] * len(self.layer_types)

    @property
    def is_linear(self):
        return [t == "linear_attention" for t in self.layer_types]

    @property
    def is_dummy(self):
        return [False] * len(self.layer_types)

    def _tensors(self):
        for c, r, lat in zip(self.conv_states, self.recurrent_states, self.latents):
            yield from (c or ())
            yield from (t for t in (r, lat) if t is not None)

    def _map(self, fn):
        """Replace every state tensor t by fn(t) (new tensors: storage_version changes)."""
        for i in range(len(self.layer_types)):
            if self.conv_states[i] is not None:
                self.conv_states[i] = tuple(fn(c) for c in self.conv_states[i])
            if self.recurrent_states[i] is not None:
                self.recurrent_states[i] = fn(self.recurrent_states[i])
            if self.latents[i] is not None:
                self.latents[i] = fn(self.latents[i])
        if self.attention_mask is not None:
            self.attention_mask = fn(self.attention_mask)
        self.storage_version += 1

    def reorder_cache(self, beam_idx):
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices):
        self._map(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats):
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self, keep_buffers=False):
        """Back to no tokens seen. keep_buffers=True zeroes the state tensors in place, so their addresses stay
        valid (a recorded decode step keeps working); otherwise they are dropped and the next call allocates."""
        if keep_buffers:
            for t in self._tensors():
                t.zero_()
        else:
            n = len(self.layer_types)
            self.conv_states, self.recurrent_states, self.latents = [None] * n, [None] * n, [None] * n
            self.storage_version += 1
        self.seen_tokens = self.source_tokens = 0
        self.attention_mask = None

    @property
    def is_croppable(self):
        return False

    def crop(self, max_length):
        raise NotImplementedError("A recurrent (KDA) state cannot be rolled back to an earlier position; "
                                  "re-prefill instead, or keep states at chunk boundaries.")

    @property
    def batch_size(self):
        for t in (self.recurrent_states + self.latents):
            if t is not None:
                return t.shape[0]
        return None

    def __repr__(self):
        return f"Kimi3Cache(layers={len(self.layer_types)}, seen_tokens={self.seen_tokens})"
