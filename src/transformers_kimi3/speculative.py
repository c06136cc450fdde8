"""Speculative decoding for Kimi3 models: the loop behind `generate(..., prompt_lookup_num_tokens=k)`,
`generate(..., assistant_model=draft)` and `generate(..., assistant_early_exit=n)`.

Each round a candidate generator proposes up to k tokens per row (copied from the row's own text, or drafted by a
smaller causal LM with the same tokenizer, or by the target's first n layers), the target checks them in one forward
of k + 1 tokens, and every row keeps its own accepted prefix plus one token of the target's. Greedy decoding returns
plain greedy's tokens; sampling keeps plain sampling's distribution (the speculative-sampling acceptance rule: a
drafted token x is kept with probability min(1, p(x) / q(x)), a rejection resamples from max(0, p - q); a
deterministic proposal, prompt lookup, is kept when the target's own sample equals it).

Caches. The target's Kimi3Cache (and a Kimi3 draft's) runs each verification as a speculation round
(`Kimi3Cache.begin_round` / `keep_rows`): KDA layers rerun their recurrence once from the round's base state over
the positions each row keeps; the rows stay aligned, and the positions a row drops become holes of its padding mask
(MLA never attends them). Any other draft keeps its own cache, cut back after each round, with holes in the attention
mask it is fed and position ids that count each row's tokens. A finished row is fed padding, as in Transformers'
loop.

Static cache (`cache_implementation="static"`): the target's cache (and a Kimi3 draft's) is a fixed buffer whose
padding mask is a buffer too, every forward after the prefill is addressed by device positions, and on one CUDA
device each step shape (the k + 1 verification tokens, a plain step, the draft's steps) is recorded once as a CUDA
graph and replayed. A verification there always feeds k + 1 tokens (a row with fewer candidates pads them; they are
rejected), so one graph serves every round.
"""

import contextlib
import copy
import inspect

import torch

from .cache import Kimi3Cache
from . import decode_graphs
from .decode_graphs import StaticCachePool, addressed_step, greedy_limits, one_device

DEFAULTS = dict(num_assistant_tokens=20, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.4,
                max_matching_ngram_size=2, temperature=1.0, top_k=50, top_p=1.0)
MEDIA = ("pixel_values", "grid_thws", "image_grid_thw")
# generation-config fields this loop reproduces (any other field only while unset / off)
CONFIG_FIELDS = {"bos_token_id", "eos_token_id", "pad_token_id", "max_length", "max_new_tokens", "min_new_tokens",
                 "do_sample", "temperature", "top_k", "top_p", "use_cache", "cache_implementation",
                 "prompt_lookup_num_tokens", "max_matching_ngram_size", "assistant_early_exit", "num_assistant_tokens",
                 "num_assistant_tokens_schedule", "assistant_confidence_threshold", "return_dict_in_generate",
                 "prefill_chunk_size", "transformers_version", "_from_model_config"}
# generate() arguments that are not config fields and that this loop takes
CALL_KWARGS = {"input_ids", "attention_mask", "assistant_model", "past_key_values", "pixel_values", "grid_thws",
               "image_grid_thw"}


def setting(config, name, default=None):
    value = getattr(config, name, None)
    return value if value is not None else DEFAULTS.get(name, default)


def resolve(model, generation_config, kwargs):
    """(config, rest): this call's generation config (the model's or the given one, updated by the kwargs that name
    config fields) and the kwargs that do not."""
    config = copy.deepcopy(generation_config or model.generation_config)
    rest = config.update(**kwargs)
    return config, rest


def unsupported(inputs, config, rest):
    """What of this call the loop does not reproduce (names), or [] when it takes the whole call."""
    out = [k for k, v in rest.items() if k not in CALL_KWARGS and v is not None
           and not (isinstance(v, (list, tuple)) and len(v) == 0)]
    out += [k for k, v in config.to_diff_dict().items() if k not in CONFIG_FIELDS and v]
    if config.use_cache is False:
        out.append("use_cache=False")
    ids = inputs if inputs is not None else rest.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] == 0:
        out.append("input_ids (a 2-D tensor of token ids)")
    elif isinstance(rest.get("attention_mask"), torch.Tensor) and rest["attention_mask"].shape != ids.shape:
        out.append("an attention_mask of another shape than input_ids (pass the whole conversation and its mask)")
    cache = rest.get("past_key_values")
    if cache is not None and not isinstance(cache, Kimi3Cache):
        out.append(f"past_key_values of type {type(cache).__name__}")
    return out


# ----------------------------------------------------------------------------------------------------------------
# scores and acceptance


def warp(scores, config):
    """Sampling's logits warpers, as Transformers orders them (temperature, top-k, top-p), on [N, vocab] scores."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    temperature, top_k, top_p = (setting(config, n) for n in ("temperature", "top_k", "top_p"))
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k=top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p=top_p)(None, scores)
    return scores


def target_scores(logits, produced, limits, config, sampling):
    """The scores [B, T, vocab] greedy decoding or sampling picks from at each of the T positions: EOS masked while
    the position's token would be among the first min_new_tokens (`produced` [B]: tokens each row has generated
    before this round; None when no position can be), then sampling's warpers."""
    scores = logits.float()
    B, T, V = scores.shape
    if produced is not None:
        index = produced.to(scores.device)[:, None] + torch.arange(T, device=scores.device)[None, :]
        eos = torch.isin(torch.arange(V, device=scores.device), torch.tensor(limits.eos, device=scores.device))
        scores = scores.masked_fill((index < limits.min_new)[..., None] & eos, float("-inf"))
    if sampling:
        scores = warp(scores.reshape(B * T, V), config).view(B, T, V)
    return scores


def accept(scores, cands, n_cand, q, sampling):
    """(n [B], token [B]): how many leading candidates each row keeps and the target's token after them.

    scores [B, k + 1, vocab] from target_scores; cands [B, k]; n_cand [B] (a row's candidates beyond it are padding);
    q [B, k, vocab]: the draft's sampling distribution of each candidate, None for a deterministic proposal."""
    B, K = cands.shape
    j = torch.arange(K, device=cands.device)[None, :]
    live = j < n_cand[:, None]
    if not sampling:
        best = scores.argmax(-1)
        n = ((cands == best[:, :K]) & live).long().cumprod(1).sum(1)
        return n, best.gather(1, n[:, None])[:, 0]
    p = scores.softmax(-1)
    if q is None:  # a deterministic proposal: the target samples every position and keeps the matching prefix
        drawn = torch.multinomial(p.view(B * (K + 1), -1), 1).view(B, K + 1)
        n = ((cands == drawn[:, :K]) & live).long().cumprod(1).sum(1)
        return n, drawn.gather(1, n[:, None])[:, 0]
    p_c = p[:, :K].gather(-1, cands[..., None])[..., 0]
    q_c = q.gather(-1, cands[..., None])[..., 0]
    kept = (torch.rand(B, K, device=p.device) * q_c < p_c) & live  # u < p / q, q > 0 where the draft sampled
    n = kept.long().cumprod(1).sum(1)
    p_n = p.gather(1, n[:, None, None].expand(-1, 1, p.shape[-1]))[:, 0]
    q_n = q.gather(1, n.clamp(max=K - 1)[:, None, None].expand(-1, 1, q.shape[-1]))[:, 0]
    residual = (p_n - q_n).clamp(min=0)
    rejected = (n < n_cand) & (residual.sum(-1) > 0)
    dist = torch.where(rejected[:, None], residual, p_n)
    return n, torch.multinomial(dist, 1)[:, 0]


# ----------------------------------------------------------------------------------------------------------------
# models within the loop


@contextlib.contextmanager
def first_layers(config, n):
    """The text config says n layers inside (an early-exit draft: the model's forward runs its first n)."""
    full, config.num_hidden_layers = config.num_hidden_layers, n
    try:
        yield
    finally:
        config.num_hidden_layers = full


class Kimi3Runner:
    """A Kimi3 model's forwards within the loop, on its Kimi3Cache: plain calls on a dynamic cache; on a static cache
    every call after the prefill is addressed by device positions and, on one CUDA device, replays a recorded graph
    per step shape. `layers`: run only the first n layers (an early-exit draft)."""

    def __init__(self, model, cache, layers=None):
        self.model, self.cache, self.layers = model, cache, layers
        self.lm = getattr(model, "language_model", model)
        self.static = cache.max_length is not None
        self.device = next(model.parameters()).device
        self.graphs = (self.static and model.decode_cuda_graph
                       and decode_graphs.graph_device(torch.empty(0, device=self.device)) and one_device(model))

    def _layers(self):
        """Inside: the text config says `layers` layers (the model's forward runs that many)."""
        return contextlib.nullcontext() if self.layers is None else first_layers(self.lm.config, self.layers)

    def prefill(self, ids, config, kwargs):
        """The prompt `ids` but its last token, beyond what the cache holds (with mask and media from kwargs)."""
        with self._layers():
            self.model._prefill_prompt_head(ids, self.cache, config, kwargs)
        if self.static:
            self.cache.track_valid(ids.shape[0], ids.device)

    def forward(self, ids):
        """Logits [B, T, vocab] of the tokens `ids` [B, T] fed after the cache's positions."""
        if not self.static:
            with self._layers():
                return self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, return_dict=True).logits
        cache = self.cache
        if not cache.in_round:
            self._room(ids.shape[1])
        if self.graphs and cache.seen_tokens > 0:  # a recording needs every state allocated: after a first step
            return self.model._static_pool().step_graph(self.lm, cache, ids).replay(cache, ids)
        return addressed_step(self.lm, cache, ids)

    def _room(self, positions):
        """A static cache: make room for `positions` more, removing the rows' holes (compact) if needed."""
        cache = self.cache
        if self.static and cache.seen_tokens + positions > cache.max_length:
            cache.compact()
            if cache.seen_tokens + positions > cache.max_length:
                raise ValueError(f"The static cache holds {cache.max_length} positions; {cache.seen_tokens} are "
                                 f"used and the next step needs {positions}")

    def begin(self, capacity):
        self._room(capacity)
        self.cache.begin_round(capacity)

    def keep(self, counts):
        self.cache.keep_rows(counts)

    def finish(self):
        if self.static:
            self.cache.release_valid()


class CausalLMRunner:
    """Any causal LM (a draft of another family) within the loop: its own cache, cut back to the longest row after
    each round; the positions a row drops become holes of the attention mask kept here, and position ids count each
    row's tokens (rotary models see their usual positions)."""

    def __init__(self, model):
        self.model, self.cache, self.mask, self.count, self.base = model, None, None, None, 0
        self.device = next(model.parameters()).device

    def prefill(self, ids, config, kwargs):
        mask = kwargs.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask.to(ids.device).long()
        ids, mask = ids[:, :-1], mask[:, :-1]
        self.mask, self.count = mask, mask.sum(1)
        if ids.shape[1]:
            position = (mask.cumsum(1) - 1).clamp(min=0)
            self.cache = self.model(input_ids=ids, attention_mask=mask, position_ids=position, use_cache=True,
                                    return_dict=True).past_key_values

    def forward(self, ids):
        B, T = ids.shape
        self.mask = torch.cat([self.mask, self.mask.new_ones(B, T)], 1)
        position = self.count[:, None] + torch.arange(T, device=ids.device)[None, :]
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=position, past_key_values=self.cache,
                         use_cache=True, return_dict=True)
        self.cache, self.count = out.past_key_values, self.count + T
        return out.logits

    def begin(self, capacity):
        self.base = self.mask.shape[1]

    def keep(self, counts):
        n = self.mask.shape[1] - self.base
        counts = torch.tensor(counts, device=self.mask.device)
        longest = int(counts.max())
        kept = (torch.arange(n, device=counts.device)[None, :] < counts[:, None]).long()
        self.mask = torch.cat([self.mask[:, :self.base], kept[:, :longest]], 1)
        self.count = self.count - n + counts
        if longest < n:
            self.cache.crop(longest - n)

    def finish(self):
        pass


# ----------------------------------------------------------------------------------------------------------------
# candidate generators


class PromptLookup:
    """Candidates copied from the row's own tokens (prompt and generated), as Transformers' prompt lookup takes them:
    the first earlier occurrence of the row's last n tokens (n from max_matching_ngram_size down to 1) that is
    followed by at least one token gives up to k of the tokens after it, cut before an EOS. Each row keeps an index
    of its n-grams' first positions, extended by the new tokens: a lookup costs O(k), not a scan of the row."""

    def __init__(self, k, ngram, eos):
        self.k, self.ngram, self.eos = k, ngram, set(eos)
        self.index, self.indexed = [], []

    def prefill(self, ids, config, kwargs):
        pass

    def lookup(self, b, row):
        if len(self.index) <= b:
            self.index.append({})
            self.indexed.append(0)
        index, length = self.index[b], len(row)
        for end in range(self.indexed[b] + 1, length + 1):  # the n-grams that end at the new tokens
            for n in range(1, min(self.ngram, end) + 1):
                index.setdefault((n,) + tuple(row[end - n:end]), end - n)
        self.indexed[b] = length
        for n in range(min(self.ngram, length - 1), 0, -1):
            first = index.get((n,) + tuple(row[length - n:]))
            if first is not None and first + n < length:  # an occurrence before the row's own last n tokens
                out = []
                for t in row[first + n:first + n + self.k]:
                    if t in self.eos:
                        break
                    out.append(t)
                return out
        return []

    def propose(self, rows, active, fixed, pad):
        """(candidates [B, w] on the device, the same on the host, counts [B] on the host, None): w = k with `fixed`
        when any row has candidates, else the most any row has."""
        found = [self.lookup(b, r) if a else [] for b, (r, a) in enumerate(zip(rows, active))]
        width = self.k if fixed and any(found) else max(map(len, found))
        host = [f + [pad] * (width - len(f)) for f in found]
        return host, host, [len(f) for f in found], None

    def accepted(self, kept, n_cand, n):
        pass

    def finish(self):
        pass


class DraftModel:
    """Candidates drafted by a causal LM with the target's tokenizer, one token per forward (greedy: its argmax;
    sampling: drawn from its own warped distribution, which the acceptance rule needs). Its cache trails the row:
    each round it is fed the row's last `lag` tokens (1 at the start, 2 after), and after the verification it keeps
    the row's tokens but the last two, so that every row, whether it accepted all candidates (the last one was never
    fed to the draft) or none, goes on with the same 2-token step. Drafting stops early when every active row's
    drafted token has a probability below assistant_confidence_threshold; "heuristic" schedules grow k by 2 after a
    round where every candidate was accepted and shrink it by 1 otherwise (dynamic cache only)."""

    def __init__(self, runner, k, schedule, threshold, config, sampling):
        self.runner, self.k, self.schedule, self.threshold = runner, k, schedule, threshold
        self.config, self.sampling, self.lag = config, sampling, 1

    def prefill(self, ids, config, kwargs):
        self.runner.prefill(ids, config, kwargs)

    def propose(self, rows, active, fixed, pad):
        """(candidates [B, w] on the device, None: on the device only, counts [B] on the host, the draft's
        distributions [B, w, vocab] when sampling): w = k with `fixed`, else the tokens drafted."""
        B, K = len(rows), self.k
        self.runner.begin(2 + K)  # one capacity for every round: a static cache's recorded steps keep serving
        x = torch.tensor([r[-self.lag:] if a else [pad] * self.lag for r, a in zip(rows, active)],
                         device=self.runner.device)
        active = torch.tensor(active, device=x.device)
        cands, qs = [], []
        for j in range(K):
            logits = self.runner.forward(x)[:, -1].float()
            if self.sampling:
                q = warp(logits, self.config).softmax(-1)
                tok = torch.multinomial(q, 1)[:, 0]
                qs.append(q)
            else:
                tok = logits.argmax(-1)
            cands.append(tok)
            if self.threshold and j + 1 < K:
                confidence = logits.softmax(-1).gather(1, tok[:, None])[:, 0]
                if not bool((confidence[active] >= self.threshold).any()):
                    break
            if j + 1 < K:
                x = tok[:, None]
        self.drafted = len(cands)
        cands = torch.stack(cands, 1)
        q = torch.stack(qs, 1) if qs else None
        if fixed and self.drafted < K:  # the verification's width stays k: the rest are padding, never accepted
            cands = torch.cat([cands, cands.new_zeros(B, K - self.drafted)], 1)
            if q is not None:
                q = torch.cat([q, q.new_zeros(B, K - self.drafted, q.shape[-1])], 1)
        return cands, None, [self.drafted] * B, q

    def accepted(self, kept, n_cand, n):
        """kept[b]: tokens row b gained this round (0 for a row finished before it); n: accepted candidates."""
        fed = self.lag + self.drafted - 1
        active = [r for r in kept if r > 0]
        counts = [min(max(self.lag + r - 2, 0), fed) for r in kept]
        longest = max((c for c, r in zip(counts, kept) if r > 0), default=fed)
        counts = [c if r > 0 else longest for c, r in zip(counts, kept)]  # a finished row: anything aligned
        self.runner.keep(counts)
        self.lag = 2
        if self.schedule in ("heuristic", "heuristic_transient") and active:
            all_in = all(a >= c for a, c, r in zip(n, n_cand, kept) if r > 0)
            self.k = self.k + 2 if all_in else max(1, self.k - 1)

    def finish(self):
        self.runner.finish()


# ----------------------------------------------------------------------------------------------------------------
# the loop


def candidate_generator(model, config, rest, static, batch, positions):
    """(candidate generator of this call, k). `positions(k)`: the positions a static cache needs for k candidates
    per round (a static Kimi3 draft's cache is sized by it)."""
    lookup = setting(config, "prompt_lookup_num_tokens")
    early_exit = setting(config, "assistant_early_exit")
    draft = rest.get("assistant_model")
    if lookup is not None and early_exit is None:  # Transformers' order: early exit, prompt lookup, a draft model
        return PromptLookup(int(lookup), int(setting(config, "max_matching_ngram_size")),
                            greedy_eos(config)), int(lookup)
    if early_exit is not None and not hasattr(model, "model"):
        raise ValueError("assistant_early_exit runs the first layers of the text model as the draft; call it on "
                         "the text model (Kimi3ForCausalLM, `model.language_model`) with a text prompt")
    draft_config = getattr(draft, "generation_config", None) if early_exit is None else None

    def pick(name):  # this call's setting, else the draft's generation config, else Transformers' default
        value = rest.get(name, getattr(config, name, None))
        if value is None and draft_config is not None:
            value = getattr(draft_config, name, None)
        return value if value is not None else DEFAULTS[name]

    k = int(pick("num_assistant_tokens"))
    if early_exit is not None:
        runner = Kimi3Runner(model, Kimi3Cache(model.config.get_text_config()), layers=int(early_exit))
    elif callable(getattr(draft, "_static_pool", None)):  # a Kimi3 model: its own cache, which rolls back
        text = draft.config.get_text_config()
        if not static:
            cache = Kimi3Cache(text)
        elif config.return_dict_in_generate:  # a returned target cache is the caller's: no pooled caches in this call
            cache = Kimi3Cache(text, max_length=-(-positions(k) // StaticCachePool.BUCKET) * StaticCachePool.BUCKET)
        else:
            cache = draft._static_pool().cache(text, batch, positions(k), next(draft.parameters()).device,
                                               weights_key(draft), kind="speculative-draft")
        runner = Kimi3Runner(draft, cache)
    else:
        runner = CausalLMRunner(draft)
    schedule = "constant" if static else pick("num_assistant_tokens_schedule")
    return DraftModel(runner, k, schedule, float(pick("assistant_confidence_threshold")), config,
                      bool(config.do_sample)), k


def weights_key(model):
    return hash(tuple(p.data_ptr() for p in model.parameters()))


def greedy_eos(config):
    eos = config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


@torch.no_grad()
def speculative_generate(model, inputs, config, rest, static):
    """generate() for a call `unsupported` found nothing against: sequences [B, prompt + new] (pad after each row's
    EOS, as Transformers returns them), or with return_dict_in_generate a GenerateDecoderOnlyOutput with the cache."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    ids = inputs if inputs is not None else rest["input_ids"]
    B, L = ids.shape
    device = ids.device
    limits = greedy_limits(config, {}, L)
    mask = rest.get("attention_mask")
    if mask is not None and mask.shape == ids.shape and not bool(mask[:, -1].all()):
        raise ValueError("attention_mask ends with padding: speculative decoding takes left-padded batches "
                         "(tokenizer.padding_side = 'left')")
    return_dict = bool(config.return_dict_in_generate)
    cache = rest.get("past_key_values")

    def output(sequences, cache):
        return GenerateDecoderOnlyOutput(sequences=sequences, past_key_values=cache) if return_dict else sequences

    if limits.max_new == 0:
        return output(ids, cache)
    sampling = bool(config.do_sample)
    text_config = model.config.get_text_config()

    def positions(k):
        """What a static cache needs: the prompt (images expanded), the new tokens, a round's overhang (k + 2); a
        batch leaves holes where rows keep fewer tokens: room for a few rounds of them before compact() runs."""
        return L + model._expanded_positions(rest) + limits.max_new + (k + 2) * (4 if B > 1 else 1)

    generator, k = candidate_generator(model, config, rest, static, B, positions)
    length = positions(k)
    if static:
        if cache is not None:
            raise ValueError("cache_implementation='static' builds its own cache: pass no past_key_values (or drop "
                             "cache_implementation to continue on a returned dynamic cache)")
        bucket = StaticCachePool.BUCKET
        cache = (Kimi3Cache(text_config, max_length=-(-length // bucket) * bucket) if return_dict else
                 model._static_pool().cache(text_config, B, length, device, weights_key(model), kind="speculative"))
    elif cache is None:
        cache = Kimi3Cache(text_config)
    elif cache.seen_tokens and cache.batch_size != B:
        raise ValueError(f"past_key_values holds {cache.batch_size} rows; input_ids has {B}")
    elif cache.seen_tokens and cache.source_tokens >= L:
        raise ValueError(f"past_key_values already holds {cache.source_tokens} input ids and input_ids has {L}: pass "
                         "the whole conversation with at least one new token")
    target = Kimi3Runner(model, cache)
    prompt_kwargs = {key: rest[key] for key in ("attention_mask",) + MEDIA if rest.get(key) is not None}
    draft_kwargs = dict(prompt_kwargs)
    if isinstance(generator, DraftModel):
        draft = generator.runner.model
        if "pixel_values" not in inspect.signature(draft.forward).parameters:
            for key in MEDIA:  # a text draft reads a media placeholder as an ordinary token
                draft_kwargs.pop(key, None)
    pad = limits.pad if limits.pad is not None else 0
    eos = set(limits.eos)
    try:
        target.prefill(ids, config, prompt_kwargs)
        generator.prefill(ids, config, draft_kwargs)
        # each row's tokens without its padding, on the host: prompt lookup reads them, a draft is fed from them
        rows = [(ids[b] if mask is None else ids[b][mask[b].bool()]).tolist() for b in range(B)]
        produced = [[] for _ in range(B)]
        finished = [False] * B
        pending = ids[:, -1]  # each row's last token, which no cache holds yet
        while not all(finished):
            cands, host, n_cand, q = generator.propose(rows, [not f for f in finished], static, pad)
            if host is not None:
                cands = torch.tensor(host, dtype=torch.long, device=device).view(B, -1)
            else:  # a draft on another device
                cands, q = cands.to(device), None if q is None else q.to(device)
            width = cands.shape[1]
            # tokens generated before this round: EOS is masked while a position is among the first min_new_tokens
            before = (torch.tensor([len(p) for p in produced], device=device)
                      if limits.min_new and limits.eos and min(map(len, produced)) < limits.min_new else None)
            if width == 0:  # nothing to check: a plain step
                scores = target_scores(target.forward(pending[:, None]), before, limits, config, sampling)
                n, token = accept(scores, cands, torch.zeros(B, dtype=torch.long, device=device), None, sampling)
            else:
                target.begin(width + 1)
                logits = target.forward(torch.cat([pending[:, None], cands], 1))
                scores = target_scores(logits, before, limits, config, sampling)
                counts = (torch.full((B,), n_cand[0], device=device) if len(set(n_cand)) == 1
                          else torch.tensor(n_cand, device=device))
                n, token = accept(scores, cands, counts, q, sampling)
            result = torch.cat([n[:, None], token[:, None], cands], 1).tolist()  # one transfer to the host
            kept = []
            for b, (accepted, tok, *cand) in enumerate(result):
                if finished[b]:
                    kept.append(0)
                    continue
                new = (cand[:accepted] + [tok])[:limits.max_new - len(produced[b])]
                for i, t in enumerate(new):
                    if t in eos:
                        new = new[:i + 1]
                        break
                produced[b] += new
                rows[b] += new
                kept.append(len(new))
                finished[b] = len(produced[b]) >= limits.max_new or new[-1] in eos
            if width:
                longest = max(kept)
                target.keep([r if r else longest for r in kept])  # a finished row keeps anything aligned
            generator.accepted(kept, n_cand, [r[0] for r in result])
            pending = token
            if any(finished):  # a finished row is fed padding, as in Transformers' loop
                pending = token.masked_fill(torch.tensor(finished, device=device), pad)
    finally:
        target.finish()
        generator.finish()
    width = max(map(len, produced))
    new = torch.full((B, width), pad, dtype=ids.dtype, device=device)
    for b, p in enumerate(produced):
        new[b, :len(p)] = torch.tensor(p, dtype=ids.dtype)
    return output(torch.cat([ids, new], 1), cache)
