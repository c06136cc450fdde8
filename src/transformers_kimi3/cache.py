"""The hybrid cache: per KDA layer the short-conv inputs and the fp32 recurrent state, per MLA layer the
compressed latent (normalised c_kv | k_pe, 576 values per token for K3) and nothing else.

Going back to an earlier position (`crop`) is trivial for MLA (the latents are cut) but not for KDA: a recurrent
state cannot be un-applied. The cache therefore keeps KDA states where they may be needed again:

- `checkpoint()` copies every KDA state at the current position; `crop()` can return there any time later (a shared
  prompt prefix, a conversation turn).
- While recording (`activate_past_recording()`, which Transformers' assisted decoding calls), each KDA layer keeps
  its state at the last crop (the rollback base) and the kernel inputs of every position fed since. `crop()` to one
  of those positions restores the base state and reruns the recurrence over the accepted positions' stored inputs
  (conv states are windows of the stored conv inputs). Nothing is recomputed when every position is kept, a rejected
  candidate costs one recurrent kernel call per KDA layer, and the memory is one state per layer plus a few vectors
  per position, instead of one state per position.
- A speculation round (`begin_round()` ... `keep_rows(counts)`, what generate()'s speculative loop runs) is the same
  record made explicit and per row: row b keeps the first counts[b] positions fed in the round. The KDA layers rerun
  their recurrences from the round's base states over the round's stored inputs, the positions a row drops turned
  into no-ops (raw gate and beta at -inf: decay 1, update 0), and take their conv windows at counts[b]; all layers
  at once (their heads side by side in one recurrence), so a round costs a fixed number of device operations
  however many KDA layers there are. The rows' MLA positions stay aligned: the positions a row drops become holes of
  the padding mask (`compact()` removes them). Every step has fixed shapes, so the static cache's recorded CUDA
  graphs can hold the round's forwards.
"""

import contextlib
import copy

import torch
from transformers.cache_utils import Cache


class Kimi3Cache(Cache):
    """Decode state of a Kimi3 / Kimi Linear stack.

    KDA layer l: `conv_states[l]` = (q, k, v) tensors [B, D, W] holding the last W conv inputs (W = kernel size;
    the official code keeps W too), `recurrent_states[l]` [B, H, K, V] float32.
    MLA layer l: `latents[l]` [B, T_seen, kv_lora_rank + qk_rope_head_dim].
    `seen_tokens` counts every position fed so far, padding included (it is the length of the 2-D mask);
    `source_tokens` counts the input ids consumed (an image placeholder counts once although its image fills many
    positions). `get_seq_length()` is `source_tokens`: Transformers compares it with input_ids and the attention mask.

    Static mode (`max_length` given, `generate(..., cache_implementation="static")`): latents live in buffers of
    `max_length` positions and every state is updated in place, so a decode step has fixed shapes and fixed
    addresses. Inside `addressed_by(position)` the write position is a device tensor instead of `seen_tokens`, so
    one recorded decode step (a CUDA graph, see generation.py) serves every position; with `track_valid()` the
    padding mask is a buffer too, which addressed forwards read and extend (a speculative loop's padded batches).
    `storage_version` changes whenever a state tensor is replaced rather than written in place: whatever holds the old
    addresses is stale.

    Going back (module docstring): `checkpoint()`, `crop(n)`, `activate_past_recording(window)`,
    `stop_past_recording()`; per row: `begin_round(capacity)` ... `keep_rows(counts)`, then `compact()`. `copy()` (or
    `copy.deepcopy`) gives an independent cache, `batch_repeat_interleave(r)` turns each row into r rows (one prefix,
    several continuations).
    """

    is_compileable = False
    ROLLBACK_WINDOW = 64  # positions a recording cache can go back by default (assisted decoding raises it to fit)

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
        self.media_end = 0  # source_tokens at the end of the last forward that expanded media placeholders
        self.checkpoints = {}  # source_tokens -> {"position", "conv", "recurrent"}: states kept by checkpoint()
        self.record_past = False
        self.rollback_window = self.ROLLBACK_WINDOW
        self._base = None  # position of the rollback base while recording (None: nothing recorded yet)
        self._records = [None] * n  # KDA layer -> {"gate", "conv", "recurrent", "inputs"} since the base
        self._plan = None  # (seen_tokens, T, kind): how the current forward is recorded, decided once for all layers
        self.valid = None  # static mode, while a speculative loop runs: the padding mask as a [B, max_length] buffer
        self._valid_buffer = None
        self._round = None  # during a speculation round: {"base": position, "capacity": positions, "layers": set()}
        self._round_bufs = {}  # KDA layer -> {"conv", "recurrent": base states, "inputs": [B, capacity, 6D+H], "gate"}
        self._round_base_t = None  # the round's base position as a device tensor [1] (addressed forwards)
        self._slots = None  # ((seen_tokens, T, device), positions): where the current forward writes in the round

    def __len__(self):
        return len(self.layer_types)

    @contextlib.contextmanager
    def addressed_by(self, position):
        """Static mode: within this block the new token is written at the device tensor `position` [1] and MLA
        reads the whole `max_length` buffer under `position_mask()`, so the step contains no Python integer that a
        recording would freeze."""
        if self.max_length is None:
            raise ValueError("Only a static cache (max_length given) can be addressed by a device position")
        self.position, self._slots = position, None
        if self.valid is not None:  # the new positions are tokens (a speculative loop's padding mask)
            self.valid.index_fill_(1, position, True)
        try:
            yield self
        finally:
            self.position = self._slots = None

    def position_mask(self, device):
        """Inside addressed_by(): the static latent positions each of the T new tokens may attend,
        [1, 1, T, max_length] (up to its own position), or [B, 1, T, max_length] while `valid` holds a padding mask
        (`track_valid()`)."""
        allowed = torch.arange(self.max_length, device=device)[None, :] <= self.position.to(device)[:, None]
        if self.valid is None:
            return allowed[None, None]
        return (allowed[None] & self.valid.to(device)[:, None, :])[:, None]

    def track_valid(self, batch_size, device):
        """Static mode: hold the padding mask in a [B, max_length] buffer, `valid`, that forwards inside
        `addressed_by` read and extend in place (a recorded CUDA graph can serve a padded batch and a speculative
        loop's holes); `attention_mask` is None meanwhile. `release_valid()` puts the mask back."""
        if self.max_length is None:
            raise ValueError("track_valid() is for a static cache (max_length given)")
        B, buf, device = batch_size, self._valid_buffer, torch.device(device)
        if buf is None or buf.shape[0] != B or buf.device != device:
            buf = self._valid_buffer = torch.zeros(B, self.max_length, dtype=torch.bool, device=device)
            self.storage_version += 1
        buf.zero_()
        buf[:, :self.seen_tokens] = True if self.attention_mask is None else self.attention_mask.bool()
        self.valid, self.attention_mask = buf, None

    def release_valid(self):
        """End `track_valid()`: the mask goes back to `attention_mask` (None when every position is valid)."""
        if self.valid is None:
            return
        mask, self.valid = self.valid[:, :self.seen_tokens], None
        self.attention_mask = None if bool(mask.all()) else mask.long()

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

    # --- going back: checkpoints, recording, crop
    def checkpoint(self):
        """Keep a copy of every KDA state at the current position, so that `crop()` can come back here however many
        tokens are fed later (a prompt prefix shared by several continuations, the end of a conversation turn).
        Returns the position in input ids (`get_seq_length()`), the argument `crop` takes. A checkpoint lives until
        a crop goes below it or `reset()`; each costs one recurrent state per KDA layer."""
        kda = [i for i, c in enumerate(self.conv_states) if c is not None]
        self.checkpoints[self.source_tokens] = {
            "position": self.seen_tokens,
            "conv": {i: tuple(t.clone() for t in self.conv_states[i]) for i in kda},
            "recurrent": {i: self.recurrent_states[i].clone() for i in kda}}
        return self.source_tokens

    def activate_past_recording(self, window=None):
        """Record from here on what `crop()` needs to go back to any position fed since the last crop (or since this
        call), as long as those are at most `window` positions (default: the current `rollback_window`). A forward
        that would exceed it starts the record again at its own start; a forward longer than `window`, or one with
        padding among its tokens, keeps only its end. Transformers' assisted decoding calls this on the cache."""
        if window is not None:
            if isinstance(window, bool) or not isinstance(window, int) or window < 1:
                raise ValueError(f"window must be a positive number of positions, not {window!r}")
            self.rollback_window = window
        self.record_past = True
        self._restart_record(self.seen_tokens)

    def stop_past_recording(self):
        """Stop recording and free what was recorded (checkpoints stay)."""
        self.record_past = False
        self._restart_record(None)

    def is_recording_past(self, layer_idx=0):
        return self.record_past

    def _restart_record(self, base):
        self._base, self._plan = base, None
        self._records = [None] * len(self.layer_types)

    def record_kda(self, layer_idx, gate, conv_states, recurrent_state, conv_inputs, kernel_inputs, padded):
        """Called by a KDA layer of a recording cache before it updates its state: `gate` (A_log, dt_bias,
        lower_bound, backend) to rerun the recurrence (`kda.kda_state_after`), the layer's states before this
        forward ((q, k, v) conv states [B, D, W] and the recurrent state, zeros where it has none yet), its conv
        inputs (q, k, v projections [B, T, D]) and the recurrence inputs (k, v, g [B, T, H, K], beta [B, T, H]) of
        this forward's T positions. `padded`: some of this forward's tokens are padding."""
        T = conv_inputs[0].shape[1]
        if self._plan is None or self._plan[:2] != (self.seen_tokens, T):
            if padded or T > self.rollback_window:
                kind, base = "end", self.seen_tokens + T
            elif self._base is None or self.seen_tokens - self._base + T > self.rollback_window:
                kind, base = "restart", self.seen_tokens
            else:
                kind, base = "append", self._base
            self._plan, self._base = (self.seen_tokens, T, kind), base
        kind = self._plan[2]
        if kind == "end":  # the base is this forward's end: the live state is the base state
            self._records[layer_idx] = None
            return
        rec = self._records[layer_idx]
        if rec is None or kind == "restart":
            rec = self._records[layer_idx] = {"gate": gate, "conv": None, "recurrent": None, "inputs": []}
        if rec["recurrent"] is None:  # the base state is the live one, which this forward is about to change
            rec["conv"] = tuple(c.clone() for c in conv_states)
            rec["recurrent"] = recurrent_state.clone()
        rec["inputs"].append(tuple(t.detach() for t in conv_inputs + kernel_inputs))

    @property
    def is_croppable(self):
        """Whether `crop()` can remove the last positions fed: always without KDA layers, else while recording."""
        return self.record_past or "linear_attention" not in self.layer_types

    def crop(self, max_length):
        """Go back to an earlier position. `max_length` <= 0 removes -max_length input ids (Transformers' convention:
        crop(0) only frees what recording kept); `max_length` > 0 keeps the first max_length input ids
        (`get_seq_length()` before the crop, or what `checkpoint()` returned).

        MLA latents are cut. The KDA states come from a checkpoint at that position, from the record kept while
        recording (the positions fed since the last crop, up to `rollback_window`), or are zeros at position 0;
        any other position raises ValueError before anything changes. Positions inside a prompt's media (before
        the end of the forward that expanded them) can be reached only through a checkpoint."""
        if isinstance(max_length, bool) or not isinstance(max_length, int):
            raise ValueError(f"max_length must be an int (<= 0: input ids to remove, > 0: input ids to keep), "
                             f"not {max_length!r}")
        keep = self.source_tokens + max_length if max_length <= 0 else max_length
        if not 0 <= keep <= self.source_tokens:
            raise ValueError(f"crop(max_length={max_length}): the cache holds {self.source_tokens} input ids, so it "
                             f"can keep between 0 and {self.source_tokens}")
        if keep == self.source_tokens:
            self._restart_record(self.seen_tokens if self.record_past else None)
            return
        point = self.checkpoints.get(keep)
        if point is not None:
            position = point["position"]
        elif keep == 0:
            position = 0
        elif keep >= self.media_end:
            position = keep + self.seen_tokens - self.source_tokens
        else:
            raise ValueError(f"crop(max_length={max_length}) would keep {keep} input ids, inside the media of the prompt "
                             f"(they end at {self.media_end}): crop to {self.media_end} or later, or to a checkpoint "
                             f"({sorted(self.checkpoints)})")
        states = {i: self._kda_state_at(i, keep, position, point, max_length)
                  for i, c in enumerate(self.conv_states) if c is not None}
        for i, (conv, rec) in states.items():  # in place: a static cache keeps its addresses
            for live, new in zip(self.conv_states[i], conv):
                live.copy_(new)
            self.recurrent_states[i].copy_(rec)
        if self.max_length is None:
            for i, lat in enumerate(self.latents):
                if lat is not None:
                    self.latents[i] = lat[:, :position]
            self.storage_version += 1
        if self.attention_mask is not None:
            self.attention_mask = self.attention_mask[:, :position]
            if bool(self.attention_mask.all()):
                self.attention_mask = None
        self.seen_tokens, self.source_tokens = position, keep
        self.checkpoints = {k: v for k, v in self.checkpoints.items() if k <= keep}
        self._restart_record(position if self.record_past else None)

    def _kda_state_at(self, i, keep, position, point, max_length):
        """((q, k, v) conv states, recurrent state) of KDA layer i at `position`."""
        if point is not None and i in point["conv"]:
            return point["conv"][i], point["recurrent"][i]
        live_conv, live_rec = self.conv_states[i], self.recurrent_states[i]
        if position == 0:
            return tuple(torch.zeros_like(c) for c in live_conv), torch.zeros_like(live_rec)
        rec = self._records[i]
        m = None if rec is None or self._base is None else position - self._base
        n_recorded = 0 if rec is None else sum(x[0].shape[1] for x in rec["inputs"])
        if m is None or not 0 <= m <= n_recorded:
            reach = (f"positions {self._base}..{self._base + n_recorded} (recorded since the last crop)"
                     if rec is not None and self._base is not None else
                     "no recorded positions (activate_past_recording() records them)")
            raise ValueError(f"crop(max_length={max_length}): no KDA state at position {position} (input id {keep}); "
                             f"reachable are {reach}, checkpoints {sorted(self.checkpoints)} and 0")
        from .kda import kda_state_after  # the recurrence the layer runs, on the stored inputs

        inputs = [torch.cat(parts, dim=1)[:, :m] for parts in zip(*rec["inputs"])]
        conv = tuple(torch.cat([c0, x.transpose(1, 2).to(c0.dtype)], dim=-1)[..., m:m + c0.shape[-1]]
                     for c0, x in zip(rec["conv"], inputs[:3]))
        recurrent = kda_state_after(rec["gate"], rec["recurrent"], *inputs[3:]) if m else rec["recurrent"]
        return conv, recurrent

    # --- speculation rounds: a different number of positions kept in each row
    @property
    def in_round(self):
        return self._round is not None

    def begin_round(self, capacity):
        """Open a speculation round at the current position. The forwards until `keep_rows()` (at most `capacity`
        positions in all, every one a token: no padding inside the round) record each KDA layer's inputs; the KDA
        states here are the round's base, copied into buffers that keep their addresses from round to round (two
        multi-tensor copies, conv states and recurrent states, however many KDA layers there are)."""
        if self.record_past:
            raise ValueError("begin_round() cannot run while the cache records for crop() (activate_past_recording)")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive number of positions, not {capacity!r}")
        self._round = {"base": self.seen_tokens, "capacity": capacity, "layers": set()}
        self._slots = None
        if self.max_length is not None:
            device = (self._valid_buffer if self._valid_buffer is not None else next(self._tensors())).device
            if self._round_base_t is None or self._round_base_t.device != device:
                self._round_base_t = torch.zeros(1, dtype=torch.long, device=device)
                self.storage_version += 1
            self._round_base_t.fill_(self.seen_tokens)
        copies = ([], [], [], [])  # conv buffers, live conv states, recurrent buffers, live recurrent states
        for i, conv in enumerate(self.conv_states):
            buf = self._round_bufs.get(i)
            if conv is None:
                if buf is not None:
                    buf["conv"] = buf["recurrent"] = None
                continue
            rec = self.recurrent_states[i]
            if buf is None:
                buf = self._round_bufs[i] = {"conv": None, "recurrent": None, "inputs": None, "gate": None}
            if buf["recurrent"] is None or buf["recurrent"].shape != rec.shape or buf["conv"][0].shape != conv[0].shape:
                buf["conv"] = tuple(c.clone() for c in conv)
                buf["recurrent"] = rec.float().clone()
            else:
                copies[0].extend(buf["conv"])
                copies[1].extend(conv)
                copies[2].append(buf["recurrent"])
                copies[3].append(rec)
        for targets, sources in (copies[:2], copies[2:]):
            if targets:
                torch._foreach_copy_(targets, sources)

    def record_round(self, layer_idx, gate, conv_inputs, kernel_inputs, conv_width, padding=None):
        """Called by a KDA layer inside a round before it updates its state: `gate` (A_log, dt_bias, lower_bound,
        backend), its conv inputs (q, k, v projections [B, T, D]) and recurrence inputs (k, v, g [B, T, H, K], beta
        [B, T, H]) of this forward's T positions, written into the round's buffer at the positions' offsets from
        the round's base (device offsets inside `addressed_by`, so a recorded graph writes where it should). The
        seven go side by side into one buffer [B, capacity, 6D + H] per layer: one concatenation and one write."""
        if padding is not None:
            raise ValueError("A speculation round's forwards feed tokens only: padding inside a round is not supported")
        xs = tuple(conv_inputs) + tuple(kernel_inputs)
        B, T = xs[0].shape[:2]
        buf = self._round_bufs.get(layer_idx)
        if buf is None:
            buf = self._round_bufs[layer_idx] = {"conv": None, "recurrent": None, "inputs": None, "gate": None}
        if buf["recurrent"] is None:  # no state before this round (an empty cache): the base is zeros
            H, K = kernel_inputs[0].shape[2:]
            buf["conv"] = tuple(x.new_zeros(B, x.shape[2], conv_width) for x in conv_inputs)
            buf["recurrent"] = torch.zeros(B, H, K, K, dtype=torch.float32, device=xs[0].device)
        row = torch.cat([x.reshape(B, T, -1) for x in xs], dim=-1).detach()
        old, capacity = buf["inputs"], self._round["capacity"]
        if (old is None or old.shape[0] != B or old.shape[1] < capacity or old.shape[2] != row.shape[2]
                or old.dtype != row.dtype or old.device != row.device):
            buf["inputs"] = row.new_zeros(B, capacity, row.shape[2])
            self.storage_version += 1
        buf["gate"] = gate
        self._round["layers"].add(layer_idx)
        buf["inputs"].index_copy_(1, self._round_slots(T, row.device), row)

    def _round_slots(self, T, device):
        """The round-buffer positions this forward's T tokens go to, made once per forward (and device) for all its
        KDA layers: the offsets from the round's base; inside `addressed_by` computed from the device position and
        kept only within that block (a recorded graph computes them itself)."""
        key = (self.seen_tokens, T, device)
        if self._slots is None or self._slots[0] != key:
            if self.position is not None:
                slots = (self.position - self._round_base_t).to(device)
            else:
                offset = self.seen_tokens - self._round["base"]
                if offset + T > self._round["capacity"]:
                    raise ValueError(f"The speculation round holds {self._round['capacity']} positions; {offset} are "
                                     f"used and this forward adds {T}")
                slots = torch.arange(offset, offset + T, device=device)
            self._slots = (key, slots)
        return self._slots[1]

    def keep_rows(self, counts, longest=None):
        """End the round: row b keeps the first `counts[b]` positions fed since `begin_round()` (a list of ints, or a
        long tensor [B], which is read on the host once; `longest`, if given, must be max(counts)). KDA states are
        those after each row's kept positions; the cache ends `longest` positions after the base, and a row that
        keeps fewer has holes in its padding mask where the rest were (its MLA queries never see them). Returns
        nothing."""
        if self._round is None:
            raise ValueError("keep_rows() ends a speculation round: call begin_round() first")
        base = self._round["base"]
        n = self.seen_tokens - base
        counts = [int(c) for c in (counts.tolist() if isinstance(counts, torch.Tensor) else counts)]
        if n and len(counts) != self.batch_size:
            raise ValueError(f"keep_rows() got {len(counts)} counts for a cache of {self.batch_size} rows")
        if not all(0 <= c <= n for c in counts):
            raise ValueError(f"keep_rows(): the round fed {n} positions; a row can keep between 0 and {n}")
        if longest is not None and int(longest) != max(counts, default=0):
            raise ValueError(f"keep_rows(): longest={longest} is not max(counts) = {max(counts, default=0)}")
        longest = max(counts, default=0)
        dropping = [b for b, c in enumerate(counts) if c < n]
        if dropping:  # rerun the KDA recurrences from the base for the rows from the first to the last that drop
            device = next(self._tensors()).device
            counts_t = torch.tensor(counts, dtype=torch.long, device=device)
            keep = torch.arange(n, device=device)[None, :] < counts_t[:, None]
            rows = slice(dropping[0], dropping[-1] + 1)
            self._keep_kda(keep[rows], counts_t[rows], rows, any(c == n for c in counts[rows]))
            if self.valid is not None:
                self.valid[:, base:base + n] = keep
            elif len(set(counts)) > 1 or self.attention_mask is not None:
                hist = (self.attention_mask[:, :base] if self.attention_mask is not None
                        else torch.ones(len(counts), base, dtype=torch.long, device=device))
                self.attention_mask = torch.cat([hist, keep[:, :longest].to(hist.dtype)], dim=1)
        drop = n - longest
        if drop:
            if self.max_length is None:
                for i, lat in enumerate(self.latents):
                    if lat is not None:
                        self.latents[i] = lat[:, :base + longest]
                self.storage_version += 1
            self.seen_tokens -= drop
            self.source_tokens -= drop
            self.checkpoints = {k: v for k, v in self.checkpoints.items() if k <= self.source_tokens}
        self._round = self._slots = None

    def _keep_kda(self, keep, counts, rows, some_full):
        """The KDA states of the batch rows `rows` after each one's kept positions (`keep` [R, n], `counts` [R]), in
        place; the rows outside keep every position, so their live states are already the ones after the round.
        `some_full`: a row inside keeps every position too, and keeps its live states.

        The layers run together, a fixed number of launches whatever their number: the recurrences as one whose
        heads are every layer's heads side by side (the kernels read A_log and dt_bias per head, so each head keeps
        its layer's gate), the conv windows as one gather. Layers differing in shapes, dtypes, device or gate kind
        form separate groups."""
        for layers in self._round_groups():
            self._keep_group(layers, keep, counts, rows, some_full)

    def _round_groups(self):
        """The round's KDA layers in groups that can rerun together (one group when the KDA layers are alike)."""
        groups = {}
        for i in sorted(self._round["layers"]):
            buf = self._round_bufs[i]
            x, conv = buf["inputs"], buf["conv"][0]
            key = (x.device, x.dtype, x.shape[2], buf["recurrent"].shape, conv.shape, conv.dtype,
                   self.conv_states[i][0].dtype, buf["gate"][2], buf["gate"][3])
            groups.setdefault(key, []).append(i)
        return list(groups.values())

    def _keep_group(self, layers, keep, counts, rows, some_full):
        from .kda import kda_state_after

        bufs = [self._round_bufs[i] for i in layers]
        device = bufs[0]["inputs"].device
        keep, counts = keep.to(device), counts.to(device)
        (R, n), L = keep.shape, len(layers)
        _, H, K, V = bufs[0]["recurrent"].shape
        D, W = bufs[0]["conv"][0].shape[1:]
        full = keep[:, -1] if some_full else None  # the rows that keep every position
        x = torch.stack([b["inputs"][rows, :n] for b in bufs], dim=2)  # [R, n, L, 6D + H]
        _, _, _, k, v, g, beta = x.split((D, D, D, H * K, H * V, H * K, H), dim=-1)

        # the recurrence from the base state; a dropped position gets raw gate and beta -inf (a no-op)
        def heads(t):  # [R, n, L, H * d] -> [R, n, L * H, d]: every layer's heads side by side
            return t.reshape(R, n, L * H, -1)

        g = heads(torch.where(keep[:, :, None, None], g, float("-inf")))
        beta = torch.where(keep[:, :, None, None], beta, float("-inf")).reshape(R, n, L * H)
        gate = (torch.cat([b["gate"][0] for b in bufs]), torch.cat([b["gate"][1] for b in bufs])) + bufs[0]["gate"][2:]
        state = torch.stack([b["recurrent"][rows] for b in bufs], dim=1).view(R, L * H, K, V)
        kda_state_after(gate, state, heads(k), heads(v), g, beta, out=state)
        self._write_back([self.recurrent_states[i][rows] for i in layers],
                         state.view(R, L, H, K, V).transpose(0, 1), full)

        # the conv states: the W inputs before each row's first dropped position, from (base conv state, inputs)
        conv = torch.stack([c[rows] for b in bufs for c in b["conv"]], dim=1).unflatten(1, (L, 3))  # [R, L, 3, D, W]
        xs = x[..., :3 * D].unflatten(-1, (3, D)).permute(0, 2, 3, 4, 1)  # [R, L, 3, D, n]
        seq = torch.cat([conv, xs.to(conv.dtype)], dim=-1).permute(1, 2, 0, 3, 4)  # [L, 3, R, D, W + n]
        window = counts[:, None] + torch.arange(W, device=device)  # [R, W]
        conv = seq.gather(-1, window[None, None, :, None].expand(L, 3, R, D, W))
        self._write_back([c[rows] for i in layers for c in self.conv_states[i]], conv.flatten(0, 1), full)

    @staticmethod
    def _write_back(live, new, full):
        """live[j] = new[j] for every j in one multi-tensor copy (one launch on CUDA: new is made dense, so each
        new[j] has live[j]'s layout); where `full` [R] (rows that keep every position) the live values stay."""
        if full is not None:
            new = torch.where(full.view((1, -1) + (1,) * (new.dim() - 2)), torch.stack(live), new)
        torch._foreach_copy_(live, list(new.contiguous().unbind(0)))

    def compact(self):
        """Remove the positions no row attends (a speculative loop's holes, left padding) from the MLA latents:
        each row's attended positions move to the end, in order, and the rows are left-padded to the longest. KDA
        states do not depend on positions and stay. Checkpoints are dropped (their positions move). Static mode
        moves the latents in place (addresses kept); returns the number of positions removed."""
        if self._round is not None:
            raise ValueError("compact() cannot run inside a speculation round")
        mask = self.valid[:, :self.seen_tokens] if self.valid is not None else self.attention_mask
        if mask is None:
            return 0
        mask = mask.bool()
        longest = int(mask.sum(1).max())
        removed = self.seen_tokens - longest
        if removed == 0:
            return 0
        # invalid positions first, then the valid ones in order (a stable sort): the last `longest` columns
        order = torch.argsort(mask.to(torch.int8), dim=1, stable=True)[:, removed:]
        new_mask = mask.gather(1, order)
        for i, lat in enumerate(self.latents):
            if lat is None:
                continue
            moved = lat[:, :self.seen_tokens].gather(1, order[..., None].expand(-1, -1, lat.shape[-1]))
            if self.max_length is None:
                self.latents[i] = moved
            else:
                lat[:, :longest] = moved
        if self.max_length is None:
            self.storage_version += 1
        if self.valid is not None:
            self.valid[:, :longest] = new_mask
            self.valid[:, longest:] = False
        else:
            self.attention_mask = None if bool(new_mask.all()) else new_mask.to(self.attention_mask.dtype)
        self.seen_tokens -= removed
        self.source_tokens -= removed
        self.checkpoints = {}
        return removed

    # --- Transformers' Cache interface
    def get_seq_length(self, layer_idx=0):
        return self.source_tokens

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
        if self._valid_buffer is not None:
            yield self._valid_buffer

    def _map(self, fn):
        """Replace every per-row tensor t (states, checkpoints, records, the mask) by fn(t) (new tensors:
        storage_version changes)."""
        for i in range(len(self.layer_types)):
            if self.conv_states[i] is not None:
                self.conv_states[i] = tuple(fn(c) for c in self.conv_states[i])
            if self.recurrent_states[i] is not None:
                self.recurrent_states[i] = fn(self.recurrent_states[i])
            if self.latents[i] is not None:
                self.latents[i] = fn(self.latents[i])
            rec = self._records[i]
            if rec is not None and rec["recurrent"] is not None:
                rec["conv"] = tuple(fn(c) for c in rec["conv"])
                rec["recurrent"] = fn(rec["recurrent"])
                rec["inputs"] = [tuple(fn(t) for t in x) for x in rec["inputs"]]
        for point in self.checkpoints.values():
            point["conv"] = {i: tuple(fn(t) for t in c) for i, c in point["conv"].items()}
            point["recurrent"] = {i: fn(r) for i, r in point["recurrent"].items()}
        if self.attention_mask is not None:
            self.attention_mask = fn(self.attention_mask)
        if self._valid_buffer is not None:
            self._valid_buffer = fn(self._valid_buffer)
            self.valid = None if self.valid is None else self._valid_buffer
        for buf in self._round_bufs.values():  # the round's base states and inputs follow the rows
            if buf["conv"] is not None:
                buf["conv"] = tuple(fn(t) for t in buf["conv"])
            for key in ("recurrent", "inputs"):
                if buf[key] is not None:
                    buf[key] = fn(buf[key])
        self.storage_version += 1

    def reorder_cache(self, beam_idx):
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices):
        self._map(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats):
        """Each row becomes `repeats` consecutive rows (checkpoints and records too): one prefix, several
        continuations in one batch."""
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def copy(self):
        """An independent copy (every tensor cloned): continue it without touching this one. Same as
        copy.deepcopy(cache)."""
        return copy.deepcopy(self)

    def __deepcopy__(self, memo):
        for rec in list(self._records) + list(self._round_bufs.values()):  # the model's gate parameters a
            if rec is not None and rec["gate"] is not None:  # record reruns the recurrence with: shared
                for t in rec["gate"]:
                    memo[id(t)] = t
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            setattr(new, key, copy.deepcopy(value, memo))
        return new

    def reset(self, keep_buffers=False):
        """Back to no tokens seen. keep_buffers=True zeroes the state tensors in place, so their addresses stay
        valid (a recorded decode step keeps working); otherwise they are dropped and the next call allocates.
        Checkpoints and records are dropped."""
        if keep_buffers:
            for t in self._tensors():
                t.zero_()
        else:
            n = len(self.layer_types)
            self.conv_states, self.recurrent_states, self.latents = [None] * n, [None] * n, [None] * n
            self._valid_buffer, self._round_bufs, self._round_base_t = None, {}, None
            self.storage_version += 1
        self.seen_tokens = self.source_tokens = self.media_end = 0
        self.attention_mask = self.valid = self._round = self._slots = None
        self.checkpoints = {}
        self._restart_record(0 if self.record_past else None)

    @property
    def batch_size(self):
        for t in (self.recurrent_states + self.latents):
            if t is not None:
                return t.shape[0]
        return None

    def __repr__(self):
        return f"Kimi3Cache(layers={len(self.layer_types)}, seen_tokens={self.seen_tokens})"
