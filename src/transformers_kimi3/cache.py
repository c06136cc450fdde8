"""The hybrid cache: per KDA layer the short-conv inputs and the fp32 recurrent state, per MLA layer the
compressed latent (normalised c_kv | k_pe, 576 values per token for K3) and nothing else."""

import torch
from transformers.cache_utils import Cache


class Kimi3Cache(Cache):
    """Decode state of a Kimi3 / Kimi Linear stack.

    KDA layer l: `conv_states[l]` = (q, k, v) tensors [B, D, W] holding the last W conv inputs (W = kernel size;
    the official code keeps W too), `recurrent_states[l]` [B, H, K, V] float32.
    MLA layer l: `latents[l]` [B, T_seen, kv_lora_rank + qk_rope_head_dim].
    `seen_tokens` counts every position fed so far, padding included (it is the length of the 2-D mask).
    """

    is_compileable = False

    def __init__(self, config, **kwargs):
        super().__init__(layers=[])
        self.layer_types = list(config.layer_types)
        n = len(self.layer_types)
        self.conv_states = [None] * n
        self.recurrent_states = [None] * n
        self.latents = [None] * n
        self.seen_tokens = 0
        self.source_tokens = 0  # input ids consumed (an image placeholder counts once)
        self.attention_mask = None  # 2-D padding mask over the seen positions, None while there is no padding

    def __len__(self):
        return len(self.layer_types)

    # --- MLA
    def update_latent(self, latent, layer_idx):
        old = self.latents[layer_idx]
        self.latents[layer_idx] = latent if old is None else torch.cat([old, latent.to(old.device)], dim=1)
        return self.latents[layer_idx]

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

    def _map(self, fn):
        for i in range(len(self.layer_types)):
            if self.conv_states[i] is not None:
                self.conv_states[i] = tuple(fn(c) for c in self.conv_states[i])
            if self.recurrent_states[i] is not None:
                self.recurrent_states[i] = fn(self.recurrent_states[i])
            if self.latents[i] is not None:
                self.latents[i] = fn(self.latents[i])
        if self.attention_mask is not None:
            self.attention_mask = fn(self.attention_mask)

    def reorder_cache(self, beam_idx):
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices):
        self._map(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats):
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self):
        n = len(self.layer_types)
        self.conv_states, self.recurrent_states, self.latents = [None] * n, [None] * n, [None] * n
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
