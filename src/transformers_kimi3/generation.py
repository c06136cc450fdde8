"""Generation for Kimi3 models: the generate() entry point and the greedy loop over a static cache (decode steps
replayed as CUDA graphs and the pool of static caches: decode_graphs.py).

Speculative decoding (`generate(..., assistant_model=draft)`, `prompt_lookup_num_tokens=k`,
`assistant_early_exit=n`) runs our loop (speculative.py: batches with left padding, each row its own accepted length,
greedy and speculative sampling, dynamic or static cache, verification steps replayed as CUDA graphs) on speculation
rounds of the `Kimi3Cache` (cache.py: `begin_round` / `keep_rows`). Options that loop does not take (other logits
processors, streamers, scores, another tokenizer's draft) go to Transformers' assisted-decoding loop at batch size 1,
on a recording `Kimi3Cache` whose `crop` rolls the KDA states back; `_speculative_generate` decides.

`generate(..., cache_implementation="static")` decodes into a fixed-size `Kimi3Cache` (state only). On CUDA each
decode step (one new token per row of an unpadded batch) is recorded once as a `DecodeGraph` and replayed: no
Python per layer, no host synchronisation. For plain greedy decoding `Kimi3GenerationMixin._static_greedy` replaces
Transformers' loop and returns the same tokens without its per-step host synchronisation. The pool
(`StaticCachePool`, one per model) keeps the caches and graphs for the next call; `release_static_caches()` frees
them. `model.fast_static_greedy = False` keeps Transformers' loop; `model.decode_cuda_graph = False` runs every
step eagerly.
"""

import copy
import inspect

import torch
from transformers import GenerationMixin

from .cache import Kimi3Cache
from .decode_graphs import StaticCachePool, graph_decodable, greedy_limits, greedy_tokens, one_device
from .input_checks import check_input_shapes
from .speculative import resolve, speculative_generate, unsupported


# ----------------------------------------------------------------------------------------------------------------
# the model side


class Kimi3GenerationMixin(GenerationMixin):
    """generate() for Kimi3 models. Generation inputs come from the cache's own bookkeeping (`source_tokens` = ids
    consumed so far), so the same code serves text-only and multimodal models, whose cache holds more positions
    than input_ids (each image placeholder becomes h*w/4 positions)."""

    _mm_keys = ("pixel_values", "grid_thws")

    fast_static_greedy = True  # plain greedy + static cache: our loop; False: Transformers' loop
    decode_cuda_graph = True  # static-cache decode steps on one CUDA device replay a recorded graph

    # generate() arguments and generation-config fields the static greedy loop reproduces exactly (other config
    # fields only while off: False/None/0); anything else (sampling, beams, logits processors, streamers, scores,
    # padding, media) goes through Transformers' loop
    _GREEDY_KWARGS = {"input_ids", "attention_mask", "max_new_tokens", "min_new_tokens", "do_sample",
                      "pad_token_id", "eos_token_id", "use_cache", "prefill_chunk_size"}
    _GREEDY_CONFIG = {"bos_token_id", "eos_token_id", "pad_token_id", "max_length", "max_new_tokens",
                      "min_new_tokens", "do_sample", "use_cache", "cache_implementation", "transformers_version",
                      "_from_model_config", "prefill_chunk_size"}

    def generate(self, inputs=None, generation_config=None, **kwargs):
        """`cache_implementation="static"` gives a fixed-size Kimi3Cache whose decode steps run as one CUDA graph
        on GPU (recorded at the first decode step, replayed after); any other value, the growing cache.
        `prefill_chunk_size=N` prefills long prompts N tokens at a time (KDA state and MLA latents carried)."""
        config = generation_config or self.generation_config
        impl = kwargs.pop("cache_implementation", None) or getattr(config, "cache_implementation", None)
        chunked = kwargs.get("prefill_chunk_size", getattr(config, "prefill_chunk_size", None))
        if chunked is not None and (isinstance(chunked, bool) or not isinstance(chunked, int) or chunked < 1):
            raise ValueError(f"prefill_chunk_size must be a positive number of tokens, not {chunked!r}")
        ids, mask = inputs if inputs is not None else kwargs.get("input_ids"), kwargs.get("attention_mask")
        if ids is not None and "inputs_embeds" not in kwargs:  # named errors before Transformers reads shapes
            check_input_shapes(ids, None, None)
        if (isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor) and ids.dim() == 2
                and mask.shape != ids.shape):
            what = (f"batch size {mask.shape[0]}, input_ids has {ids.shape[0]}" if mask.shape[0] != ids.shape[0]
                    else f"shape {list(mask.shape)}, input_ids {list(ids.shape)}: one value per prompt token")
            raise ValueError(f"attention_mask has {what}")
        if self._speculative(config, kwargs):
            return self._speculative_generate(inputs, generation_config, config, impl, kwargs)
        if impl == "static" and self._plain_greedy(inputs, generation_config, kwargs):
            return self._static_greedy(inputs if inputs is not None else kwargs["input_ids"], config, kwargs)
        if (impl == "static" or chunked) and kwargs.get("past_key_values") is None:
            # Transformers' chunked prefill needs a cache object up front; ours is never built by generate()
            ids = inputs if inputs is not None else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
            max_new = kwargs.get("max_new_tokens") or getattr(config, "max_new_tokens", None) or 20
            length = ids.shape[1] + self._expanded_positions(kwargs) + max_new
            kwargs["past_key_values"] = Kimi3Cache(self.config.get_text_config(),
                                                   max_length=length if impl == "static" else None)
        if generation_config is not None and getattr(generation_config, "cache_implementation", None):
            generation_config = copy.deepcopy(generation_config)
            generation_config.cache_implementation = None
        return super().generate(inputs, generation_config=generation_config, **kwargs)

    # ---- speculative decoding: Transformers' assisted-decoding loop over a cache that rolls back
    _MEDIA_KWARGS = ("pixel_values", "grid_thws", "image_grid_thw")

    @staticmethod
    def _speculative(config, kwargs):
        """Whether this generate() call is speculative decoding: as the target (an assistant model, prompt lookup or
        early exit) or as the draft of another model's call (`is_assistant`)."""
        def get(name):
            return kwargs[name] if name in kwargs else getattr(config, name, None)
        return (kwargs.get("assistant_model") is not None or get("prompt_lookup_num_tokens") is not None
                or get("assistant_early_exit") is not None or bool(get("is_assistant")))

    def _speculative_generate(self, inputs, generation_config, config, impl, kwargs):
        """Speculative decoding as the target: our loop (speculative.py) for every call it reproduces. Otherwise,
        and as the draft of another model's call, Transformers' assisted decoding on a dynamic Kimi3Cache that
        records what `crop` needs. The prompt but its last token is prefilled first, outside the record: every
        recorded forward is then a short one (the target's verification of k candidates, the draft's steps), so the
        record holds a few positions and never a prompt. The target's cache stops recording when the call returns; a
        draft's keeps recording for the next round (Transformers crops it between rounds)."""
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        cache = kwargs.get("past_key_values")
        what = "assisted generation (assistant_model, prompt_lookup_num_tokens or assistant_early_exit)"
        if not (kwargs.get("is_assistant") or getattr(config, "is_assistant", False)):
            ours, rest = resolve(self, generation_config, kwargs)
            missing = unsupported(inputs, ours, rest)
            if not missing:
                return speculative_generate(self, inputs, ours, rest, impl == "static")
            if impl == "static" or (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] != 1):
                raise ValueError(f"{what} with {', '.join(missing)}: our speculative loop does not reproduce that, "
                                 "and Transformers' loop, which does, decodes one row on the dynamic cache; drop "
                                 "those options, or call generate() once per row without cache_implementation="
                                 "'static'")
        if impl == "static" or (isinstance(cache, Kimi3Cache) and cache.max_length is not None):
            raise ValueError(f"{what} with these options runs in Transformers' loop, on the dynamic cache only: pass "
                             "a Kimi3Cache without max_length")
        if cache is not None and not isinstance(cache, Kimi3Cache):
            raise ValueError(f"past_key_values must be a Kimi3Cache for {what}, got {type(cache).__name__}")
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] != 1:
            raise ValueError(f"{what} decodes one sequence at a time (Transformers' assisted decoding supports batch "
                             f"size 1): input_ids has {ids.shape[0]} rows; call generate() once per row")
        early_exit = kwargs.get("assistant_early_exit", getattr(config, "assistant_early_exit", None))
        if early_exit is not None and not hasattr(self, "model"):
            raise ValueError("assistant_early_exit runs the first layers of the text model as the draft; call it on "
                             "the text model (Kimi3ForCausalLM, `model.language_model`) with a text prompt")
        draft = bool(getattr(config, "is_assistant", False))
        if draft and "pixel_values" not in inspect.signature(self.forward).parameters:
            for key in self._MEDIA_KWARGS:  # a text draft reads a media placeholder as an ordinary token
                kwargs.pop(key, None)
        if cache is None:
            cache = kwargs["past_key_values"] = Kimi3Cache(self.config.get_text_config())
        if not cache.record_past:
            self._prefill_prompt_head(ids, cache, config, kwargs)
        max_new = kwargs.get("max_new_tokens") or getattr(config, "max_new_tokens", None)
        if max_new is None and getattr(config, "max_length", None) and isinstance(ids, torch.Tensor):
            max_new = config.max_length - ids.shape[-1]
        # a round can roll back every candidate it verified: at most the tokens still to generate
        cache.rollback_window = max(cache.rollback_window, (max_new or 0) + 2)
        if draft and not cache.record_past:
            cache.activate_past_recording()  # Transformers activates the target's cache itself
        try:
            return super().generate(inputs, generation_config=generation_config, **kwargs)
        finally:
            if not draft:
                cache.stop_past_recording()

    @torch.no_grad()
    def _prefill_prompt_head(self, ids, cache, config, kwargs):
        """Feed `ids` but its last token into `cache` (the part the cache has not consumed yet), with the attention
        mask and, on an empty cache, the media. Nothing when the prompt is given as embeddings, or as the new ids
        only (an attention mask longer than the ids): Transformers' loop then feeds it as usual."""
        mask = kwargs.get("attention_mask")
        if (not isinstance(ids, torch.Tensor) or ids.dim() != 2 or kwargs.get("inputs_embeds") is not None
                or (mask is not None and mask.shape[-1] != ids.shape[1])):
            return
        history = cache.source_tokens if cache.seen_tokens else 0
        end = ids.shape[1] - 1
        if end <= history:
            return
        media = {k: kwargs[k] for k in self._MEDIA_KWARGS if kwargs.get(k) is not None} if history == 0 else {}
        if media.get("pixel_values") is not None and bool((ids[:, -1] == self.config.media_placeholder_token_id).any()):
            raise ValueError("input_ids end with a media placeholder: assisted generation feeds the prompt's last "
                             "token together with the first candidates, after the media are encoded; end the "
                             "prompt with text (a chat template's assistant header does)")
        chunk = kwargs.get("prefill_chunk_size") or getattr(config, "prefill_chunk_size", None) or end
        chunk = end if media else chunk  # the media go in with their placeholders, in one forward
        for start in range(history, end, chunk):
            stop = min(start + chunk, end)
            self(input_ids=ids[:, start:stop], attention_mask=None if mask is None else mask[:, start:stop],
                 past_key_values=cache, use_cache=True, logits_to_keep=1, return_dict=True,
                 **(media if start == history else {}))

    def _expanded_positions(self, kwargs):
        """How many cache positions the prompt gains inside the model beyond its input_ids (image placeholders
        expand to their images' rows); a static cache is sized for them."""
        return 0

    def _plain_greedy(self, inputs, generation_config, kwargs):
        config = generation_config or self.generation_config
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        mask = kwargs.get("attention_mask")
        return (self.fast_static_greedy and isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] > 0
                and set(kwargs) <= self._GREEDY_KWARGS and not kwargs.get("do_sample")
                and kwargs.get("use_cache", True) is not False
                and all(k in self._GREEDY_CONFIG or not v for k, v in config.to_diff_dict().items())
                and not config.do_sample
                and (bool(mask.all()) if mask is not None else not self._pad_in(ids, kwargs, config)))

    @staticmethod
    def _pad_in(ids, kwargs, config):
        # without an attention_mask Transformers treats pad ids in the prompt as padding: its loop handles that
        pad = kwargs.get("pad_token_id", config.pad_token_id)
        return pad is not None and bool((ids == pad).any())

    @torch.no_grad()
    def _static_greedy(self, input_ids, config, kwargs):
        """Greedy decoding through a pooled static cache: a (chunked) prefill, then one forward per token, each a
        graph replay plus a few queued tensor ops on CUDA (see greedy_tokens)."""
        B, L = input_ids.shape
        limits = greedy_limits(config, kwargs, L)
        if limits.max_new == 0:
            return input_ids
        weights = hash(tuple(p.data_ptr() for p in self.parameters()))
        cache = self._static_pool().cache(self.config.get_text_config(), B, L + limits.max_new, input_ids.device,
                                          weights)
        chunk = kwargs.get("prefill_chunk_size") or getattr(config, "prefill_chunk_size", None) or L
        for start in range(0, L, chunk):  # peak memory bounded by the chunk, not the prompt
            logits = self(input_ids=input_ids[:, start:start + chunk], past_key_values=cache, use_cache=True,
                          logits_to_keep=1, return_dict=True).logits[:, -1]

        def next_logits(tok):
            return self(input_ids=tok[:, None], past_key_values=cache, use_cache=True, return_dict=True).logits[:, -1]

        return torch.cat([input_ids, greedy_tokens(next_logits, logits, limits)], dim=1)

    def _static_pool(self):
        pool = self.__dict__.get("_kimi3_static_pool")  # not an nn.Module attribute: no state_dict, no .to()
        if pool is None:
            pool = self.__dict__["_kimi3_static_pool"] = StaticCachePool()
        return pool

    def release_static_caches(self):
        """Drop the static caches and decode graphs kept between generate() calls (frees their memory)."""
        self.__dict__.pop("_kimi3_static_pool", None)

    def _replayed_logits(self, lm, cache, input_ids, labels, output_hidden_states, output_router_logits):
        """This forward call's logits from a replay of text model `lm`'s recorded decode step, or None where the
        call runs eagerly (see graph_decodable; a model spread over devices always does)."""
        if not (self.decode_cuda_graph
                and graph_decodable(cache, input_ids, labels, output_hidden_states, output_router_logits)
                and one_device(self)):
            return None
        return self._static_pool().graph(lm, cache, input_ids).replay(cache, input_ids)

    @classmethod
    def _supports_default_dynamic_cache(cls):
        # generate() must not build a DynamicCache for us (it cannot describe KDA state, and a stack without
        # attention layers makes its get_seq_length raise); our forward creates a Kimi3Cache instead.
        return False

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, past_key_values=None,
                                      attention_mask=None, inputs_embeds=None, is_first_iteration=False, **kwargs):
        """The inputs of one forward call of generate(), by the rules of Transformers' GenerationMixin method of
        the same name, with the history counted in the cache's `source_tokens` (the ids and embedding rows it has
        consumed; an image placeholder counts once although its image fills many cache positions):

        - `inputs_embeds` feed the first forward of a generate() call (`is_first_iteration`, or a cache that has
          consumed nothing); every later step feeds `input_ids`, which then end with the generated tokens.
        - On a cache that has consumed tokens only the rest is fed. A decode step feeds the last
          `next_sequence_length` ids. The first forward of a call continuing on a returned cache takes the whole
          conversation (ids or embeddings, whose first `source_tokens` positions the cache holds) or only its new
          part: the new part when the input is not longer than the history, or when `attention_mask` is longer
          than the input (it spans the history too), as Transformers reads input_ids.
        - The attention mask is cut to the fed positions; the model puts the cache's history in front of it.
        """
        for k in ("cache_position", "position_ids", "labels"):
            kwargs.pop(k, None)
        cache = past_key_values if isinstance(past_key_values, Kimi3Cache) else None
        history = cache.source_tokens if cache is not None and cache.seen_tokens > 0 else 0
        if inputs_embeds is not None and (is_first_iteration or history == 0):
            name, x = "inputs_embeds", inputs_embeds
        else:
            name, x = "input_ids", input_ids
        new = x.shape[1]
        if history:
            if not is_first_iteration and next_sequence_length is not None:  # a decode step
                new = next_sequence_length
            elif new > history and (attention_mask is None or attention_mask.shape[1] == new):
                new -= history  # the whole conversation
            x = x[:, x.shape[1] - new:]
            if attention_mask is not None:
                attention_mask = attention_mask[:, attention_mask.shape[1] - new:]
            for k in self._mm_keys:  # media is encoded once, at prefill
                kwargs.pop(k, None)
        inputs = {name: x, "attention_mask": attention_mask, "past_key_values": past_key_values}
        inputs.update(kwargs)
        return inputs
