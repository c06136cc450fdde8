"""The machinery under generate() that speculative decoding shares with the greedy loop: decode steps addressed by
device positions and replayed as CUDA graphs (`DecodeGraph`), the pool that keeps static caches and their graphs
between calls (`StaticCachePool`), and the greedy loop's stopping rules (`greedy_limits`, `greedy_tokens`).
generation.py (the generate() entry point) and speculative.py (the speculative loop) both build on it.
"""

import collections
import weakref
from typing import NamedTuple, Optional

import torch

from .cache import Kimi3Cache

CHECK_EVERY = 16  # greedy steps between host checks for "every row has finished" (each check waits for the GPU)


# ----------------------------------------------------------------------------------------------------------------
# decode steps as CUDA graphs


def graph_device(t):
    """Whether a decode step on `t`'s device can be recorded as a graph: CUDA."""
    return t.is_cuda


def graph_decodable(cache, input_ids, labels, output_hidden_states, output_router_logits):
    """A forward call a recorded decode step serves: one new token per row of an unpadded batch, on a static cache
    that holds a prompt and has room for the token, on CUDA, for inference, asking for logits only."""
    return (isinstance(cache, Kimi3Cache) and cache.max_length is not None and not cache.record_past
            and not cache.in_round and cache.valid is None
            and input_ids is not None and input_ids.shape[1] == 1 and graph_device(input_ids)
            and 0 < cache.seen_tokens < cache.max_length and cache.attention_mask is None
            and labels is None and not output_hidden_states and not output_router_logits
            and not torch.is_grad_enabled())


def one_device(model):
    """A CUDA graph is recorded on one device and cannot hold the weights Accelerate moves in at each forward
    (CPU / disk offload): a model spread by a device_map decodes eagerly."""
    placed = {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}
    return len(placed) <= 1 and not placed & {"cpu", "disk"}


def cuda_warm_up(step):
    """Run `step` twice on a side stream before recording: lazy initialisations (cuBLAS handles, Triton
    autotuning) must not happen inside the recording."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)


def cuda_record(step):
    """(graph, output): `step` recorded as a CUDA graph; each replay rewrites `output` in place."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = step()
    return graph, output


def addressed_forward(lm, cache, ids, position):
    """The logits [B, T, vocab] of text model `lm` fed `ids` [B, T] on static cache `cache`, addressed by the device
    tensor `position` [T] (the positions the tokens are written at); the cache's counters are left as they were.
    Several tokens go in as embeddings: the ids check of a forward reads them on the host, which a graph cannot."""
    counters = (cache.seen_tokens, cache.source_tokens)
    try:
        with cache.addressed_by(position):
            if ids.shape[1] == 1:
                out = lm.model(input_ids=ids, past_key_values=cache, use_cache=True, return_dict=True)
            else:
                out = lm.model(inputs_embeds=lm.get_input_embeddings()(ids), past_key_values=cache, use_cache=True,
                               return_dict=True)
            return lm.lm_head(out.last_hidden_state)
    finally:  # recording runs the step without consuming a position
        cache.seen_tokens, cache.source_tokens = counters


def addressed_step(lm, cache, ids):
    """`addressed_forward` at the cache's next positions, run eagerly; advances the cache by T."""
    T = ids.shape[1]
    position = torch.arange(cache.seen_tokens, cache.seen_tokens + T, device=ids.device)
    logits = addressed_forward(lm, cache, ids, position)
    cache.seen_tokens += T
    cache.source_tokens += T
    return logits


class DecodeGraph:
    """One decode step (T tokens per row, usually 1) of text model `lm` on static cache `cache`, recorded as a CUDA
    graph.

    A graph replays fixed kernels on fixed addresses, so everything that changes between steps lives in tensors it
    owns: the token ids are copied into `ids`, the write positions into `position` (the cache is addressed by it
    while the step is recorded), and the logits appear in `logits`. It reads the cache's tensors and the weights at
    the addresses they had when recorded: it serves the cache while `storage_version` and the batch shape are
    unchanged. It holds no reference to the cache (the pool keys graphs by cache, weakly)."""

    def __init__(self, lm, cache, input_ids):
        self.ids = input_ids.clone()
        self.offsets = torch.arange(input_ids.shape[1], device=input_ids.device)
        self.position = self.offsets + cache.seen_tokens
        step = lambda: addressed_forward(lm, cache, self.ids, self.position)  # noqa: E731
        snap = cache.snapshot()
        cuda_warm_up(step)
        cache.restore(snap)  # the warm-up steps wrote the next token's state: undo them
        self.graph, self.logits = cuda_record(step)
        self.storage_version = cache.storage_version
        # the KDA layers that record into a speculation round (a replay runs no Python to tell the cache)
        self.round_layers = set(cache._round["layers"]) if cache.in_round else set()

    def fits(self, cache, input_ids):
        return self.storage_version == cache.storage_version and self.ids.shape == input_ids.shape

    def replay(self, cache, input_ids):
        """The logits [B, T, vocab] after `input_ids` [B, T]; advances the cache by T."""
        T = input_ids.shape[1]
        self.ids.copy_(input_ids)
        torch.add(self.offsets, cache.seen_tokens, out=self.position)
        self.graph.replay()
        cache.seen_tokens += T
        cache.source_tokens += T
        if cache.in_round:
            cache._round["layers"] |= self.round_layers
        return self.logits.clone()


class StaticCachePool:
    """What a model keeps between generate() calls: static caches for its greedy loop and the decode graph
    recorded on each static cache it decoded (pooled or the caller's). Recording a graph costs tens of
    milliseconds, so calls of the same batch size and length bucket share a cache and its graph. Caches are keyed
    by the weights' addresses too (a graph reads the weights through them); graphs are keyed by their cache and
    dropped with it. A copy of the model gets an empty pool."""

    BUCKET = 256  # static caches are sized in steps of this many positions, so calls can share them
    SIZE = 2  # pooled caches (with their graphs) kept alive; each holds GPU memory

    def __init__(self):
        self.caches = collections.OrderedDict()
        self.graphs = weakref.WeakKeyDictionary()
        self.step_graphs = weakref.WeakKeyDictionary()  # cache -> {(T, in a speculation round): graph}

    def __reduce__(self):  # copy.deepcopy / pickle: graphs point at the original's memory
        return type(self), ()

    def cache(self, config, batch, length, device, weights, kind="greedy"):
        """An empty static cache for `batch` rows of up to `length` positions (rounded up to the bucket); `kind`
        keeps the caches of different loops apart (a speculative loop's target and draft)."""
        length = -(-length // self.BUCKET) * self.BUCKET
        key = (batch, length, str(device), weights, kind)
        cache = self.caches.pop(key, None)
        if cache is None:
            cache = Kimi3Cache(config, max_length=length)
        else:  # a recorded graph keeps serving the cache only while its tensors stay where they are
            cache.reset(keep_buffers=cache in self.graphs or cache in self.step_graphs)
        self.caches[key] = cache
        while len(self.caches) > self.SIZE:
            self.caches.popitem(last=False)
        return cache

    def graph(self, lm, cache, input_ids):
        """The decode graph of `lm` on `cache`, recorded now if there is none that fits."""
        graph = self.graphs.get(cache)
        if graph is None or not graph.fits(cache, input_ids):
            self.graphs.pop(cache, None)  # free the stale graph's memory before recording
            graph = self.graphs[cache] = DecodeGraph(lm, cache, input_ids)
        return graph

    def step_graph(self, lm, cache, input_ids):
        """The graph of a speculative loop's step of T = input_ids.shape[1] tokens on `cache` (inside a speculation
        round or not), recorded now if there is none that fits."""
        graphs = self.step_graphs.setdefault(cache, {})
        key = (input_ids.shape[1], cache.in_round)
        graph = graphs.get(key)
        if graph is None or not graph.fits(cache, input_ids):
            if graph is not None and graph.storage_version != cache.storage_version:
                graphs.clear()  # every graph of the cache read the replaced tensors
            graphs.pop(key, None)
            graph = graphs[key] = DecodeGraph(lm, cache, input_ids)
        return graph


# ----------------------------------------------------------------------------------------------------------------
# greedy decoding over a static cache


class GreedyLimits(NamedTuple):
    max_new: int
    min_new: int
    eos: list
    pad: Optional[int]


def greedy_limits(config, kwargs, prompt_length):
    """max_new_tokens, min_new_tokens, EOS ids and pad id as Transformers resolves them for greedy decoding."""
    max_new = kwargs.get("max_new_tokens") or config.max_new_tokens
    if max_new is None:  # Transformers' default max_length is 20
        max_new = max((config.max_length if config.max_length is not None else 20) - prompt_length, 0)
    min_new = kwargs.get("min_new_tokens") or config.min_new_tokens or 0
    eos = kwargs.get("eos_token_id", config.eos_token_id)
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    pad = kwargs.get("pad_token_id", config.pad_token_id)
    pad = eos[0] if pad is None and eos else pad
    return GreedyLimits(max_new, min_new, eos, pad)


def greedy_tokens(next_logits, logits, limits):
    """The new tokens [B, <=max_new] of greedy decoding from the prompt's last `logits` [B, vocab], as Transformers'
    loop returns them: EOS masked for the first min_new steps (ids outside the vocabulary ignored), finished rows
    padded, stop at the step where the last row finished. `next_logits(tok)` feeds tok [B] and returns the next
    logits; whether all rows finished is read on the host every CHECK_EVERY steps only."""
    B, device = logits.shape[0], logits.device
    max_new, min_new, eos, pad = limits
    eos_t = torch.tensor(eos, dtype=torch.long, device=device)
    eos_columns = torch.isin(torch.arange(logits.shape[-1], device=device), eos_t)
    out = torch.full((B, max_new), pad if pad is not None else 0, dtype=torch.long, device=device)
    unfinished = torch.ones(B, dtype=torch.bool, device=device)
    for step in range(max_new):
        scores = logits.float()
        if step < min_new and eos:
            scores = scores.masked_fill(eos_columns, float("-inf"))
        tok = scores.argmax(-1)
        if pad is not None:
            tok = torch.where(unfinished, tok, torch.full_like(tok, pad))
        out[:, step] = tok
        if eos:
            unfinished &= ~torch.isin(tok, eos_t)
            if ((step + 1) % CHECK_EVERY == 0 or step + 1 == max_new) and not bool(unfinished.any()):
                break
        if step + 1 < max_new:
            logits = next_logits(tok)
    return _cut_after_last_finish(out, eos_t) if eos else out


def _cut_after_last_finish(out, eos_t):
    """Columns up to the first step at which every row has produced an EOS."""
    done = torch.isin(out, eos_t).cumsum(1).clamp(max=1).bool()
    all_done = done.all(0)
    if bool(all_done.any()):
        out = out[:, : int(all_done.nonzero()[0]) + 1]
    return out
