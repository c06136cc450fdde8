"""Our `GenerationTesterMixin`: the generation behaviours Transformers' own mixin tests (its file,
tests/generation/test_utils.py, is not in the sdist), written for our models. upstream_tests.py installs it where
`test_modeling_common` imports `GenerationTesterMixin` from, so every tester class that runs the common model tests
runs these with its own layout (`self.model_tester`, `self.all_generative_model_classes`).

Covered, each against a reference computed without generate(): greedy decoding with every dict output (scores,
logits, hidden states, MLA attentions, the cache), sampling (seeded, several sequences), beam search (scores
against a fresh forward), left padding, generation from inputs_embeds, continuing from a returned cache, the static
cache (same tokens and logits as the dynamic one), assisted and prompt-lookup decoding (same tokens as greedy) and
logits_to_keep. Not a test module (no test file of its own)."""

import copy

import torch

from transformers import GenerationConfig
from transformers_kimi3 import Kimi3Cache

# fp32 rounding of the same math in another order (chunked vs recurrent KDA, cached vs recomputed MLA); a wrong
# cache or mask gives errors of 1e-2 and more
ATOL = 1e-4


class GenerationTesterMixin:
    max_new_tokens = 3

    # ---- helpers
    def _generation_inputs(self, batch_size=2):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        inputs = {k: v for k, v in inputs.items() if k != "attention_mask"}
        inputs = self.model_tester.slice_inputs(inputs, batch_size) if hasattr(self.model_tester, "slice_inputs") \
            else {k: v[:batch_size] for k, v in inputs.items()}
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        return config, inputs

    def _suppressed(self):
        """Token ids generation must not produce (a multimodal model's media placeholder: fed back without pixels
        it is an ordinary token to the cache, while the cache-free reference would read it as an image)."""
        return list(getattr(self.model_tester, "suppressed_tokens", ()))

    def _model(self, model_class, config):
        torch.manual_seed(0)
        model = model_class(copy.deepcopy(config)).eval()
        # eos -1: never finish early, so every call returns max_new_tokens tokens
        model.generation_config = GenerationConfig(eos_token_id=-1, pad_token_id=config.get_text_config().pad_token_id,
                                                   suppress_tokens=self._suppressed() or None)
        return model

    @staticmethod
    def _repeat_rows(inputs, r):
        """Each row `r` times, its images with it (pixel_values are packed patches, grid_thws one row per image,
        one image per row here)."""
        out = {k: v.repeat_interleave(r, 0) for k, v in inputs.items() if k not in ("pixel_values", "grid_thws")}
        if "pixel_values" in inputs:
            sizes = inputs["grid_thws"].prod(-1).tolist()
            out["pixel_values"] = torch.cat([p for p in inputs["pixel_values"].split(sizes) for _ in range(r)])
            out["grid_thws"] = inputs["grid_thws"].repeat_interleave(r, 0)
        return out

    def _reference_logits(self, model, sequences, inputs, prompt_length):
        """Logits of every generated position from one forward over the whole sequence, without a cache."""
        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
        with torch.no_grad():
            logits = model(input_ids=sequences[:, :-1], use_cache=False, **extra).logits
        return logits[:, prompt_length - 1:]

    def _greedy(self, model, inputs, **kwargs):
        with torch.no_grad():
            return model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False, **kwargs)

    def _mla_layers(self, config):
        return config.get_text_config().layer_types.count("full_attention")

    # ---- tests
    def test_greedy_generate_dict_outputs(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self._generation_inputs()
            model = self._model(model_class, config)
            out = self._greedy(model, inputs, return_dict_in_generate=True, output_scores=True, output_logits=True,
                               output_hidden_states=True, output_attentions=True)
            B, T = inputs["input_ids"].shape
            n, text = self.max_new_tokens, config.get_text_config()
            self.assertEqual(tuple(out.sequences.shape), (B, T + n))
            self.assertIsInstance(out.past_key_values, Kimi3Cache)
            self.assertEqual(out.past_key_values.get_seq_length(), T + n - 1)
            logits = torch.stack(out.logits, 1)
            expected_scores = logits.clone()
            expected_scores[..., self._suppressed()] = float("-inf")
            torch.testing.assert_close(torch.stack(out.scores, 1), expected_scores)  # no other logits processor
            torch.testing.assert_close(logits, self._reference_logits(model, out.sequences, inputs, T),
                                       atol=ATOL, rtol=0)
            self.assertTrue(torch.equal(out.sequences[:, T:], logits.argmax(-1)))
            self.assertEqual(len(out.hidden_states), n)
            self.assertEqual(len(out.attentions), n)
            prompt = out.past_key_values.seen_tokens - (n - 1)  # cache positions of the prompt (media rows too)
            for step, (hidden, attentions) in enumerate(zip(out.hidden_states, out.attentions)):
                q, kv = (prompt, prompt) if step == 0 else (1, prompt + step)  # the prefill, then one token each
                self.assertEqual(len(hidden), text.num_hidden_layers + 1)
                self.assertTrue(all(tuple(h.shape) == (B, q, text.hidden_size) for h in hidden))
                self.assertEqual(len(attentions), self._mla_layers(config))
                self.assertTrue(all(tuple(a.shape) == (B, text.num_attention_heads, q, kv) for a in attentions))

    def test_sample_generate(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self._generation_inputs()
            model = self._model(model_class, config)
            runs = []
            for _ in range(2):
                torch.manual_seed(7)
                with torch.no_grad():
                    runs.append(model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=True,
                                               top_k=5, num_return_sequences=2))
            B, T = inputs["input_ids"].shape
            self.assertEqual(tuple(runs[0].shape), (2 * B, T + self.max_new_tokens))
            self.assertTrue(torch.equal(runs[0], runs[1]))
            self.assertTrue(torch.equal(runs[0][::2, :T], inputs["input_ids"]))

    def test_beam_search_generate_dict_output(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self._generation_inputs()
            model = self._model(model_class, config)
            out = self._greedy(model, inputs, num_beams=2, num_return_sequences=2, return_dict_in_generate=True,
                               output_scores=True, length_penalty=1.0)
            B, T = inputs["input_ids"].shape
            self.assertEqual(tuple(out.sequences.shape), (2 * B, T + self.max_new_tokens))
            # each returned beam's score is its log-probability from a fresh forward (the cache was reordered right)
            # (logits processors such as suppress_tokens act on the log-probabilities: they do not renormalise)
            ref = self._reference_logits(model, out.sequences, self._repeat_rows(inputs, 2), T).float().log_softmax(-1)
            logp = ref.gather(-1, out.sequences[:, T:, None])[..., 0].sum(-1) / self.max_new_tokens
            torch.testing.assert_close(out.sequences_scores, logp, atol=ATOL, rtol=0)

    def test_left_padding_compatibility(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self._generation_inputs()
            model = self._model(model_class, config)
            pad = config.get_text_config().pad_token_id
            ids, mask = inputs["input_ids"], inputs["attention_mask"]
            padded = {**inputs, "input_ids": torch.cat([torch.full_like(ids[:, :3], pad), ids], 1),
                      "attention_mask": torch.cat([torch.zeros_like(mask[:, :3]), mask], 1)}
            plain = self._greedy(model, inputs, return_dict_in_generate=True, output_logits=True)
            left = self._greedy(model, padded, return_dict_in_generate=True, output_logits=True)
            torch.testing.assert_close(torch.stack(left.logits), torch.stack(plain.logits), atol=ATOL, rtol=0)
            self.assertTrue(torch.equal(left.sequences[:, 3:], plain.sequences))

    def test_generate_from_inputs_embeds(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self._generation_inputs()
            if set(inputs) - {"input_ids", "attention_mask"}:
                continue  # media need input_ids with placeholders (the model refuses embeddings with pixels)
            model = self._model(model_class, config)
            embeds = model.get_input_embeddings()(inputs["input_ids"])
            from_ids = self._greedy(model, inputs, return_dict_in_generate=True, output_logits=True)
            from_embeds = self._greedy(model, {"inputs_embeds": embeds, "attention_mask": inputs["attention_mask"]},
                                       return_dict_in_generate=True, output_logits=True)
            # generate() returns only the new tokens when given embeddings only
            self.assertTrue(torch.equal(from_embeds.sequences, from_ids.sequences[:, embeds.shape[1]:]))
            torch.testing.assert_close(torch.stack(from_embeds.logits), torch.stack(from_ids.logits), atol=ATOL,
                                       rtol=0)

    def test_generate_continue_from_past_key_values(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self._generation_inputs()
            model = self._model(model_class, config)
            whole = self._greedy(model, inputs, return_dict_in_generate=True, output_logits=True)
            with torch.no_grad():
                first = model.generate(**inputs, max_new_tokens=1, do_sample=False, return_dict_in_generate=True,
                                       output_logits=True)
                rest = model.generate(input_ids=first.sequences, past_key_values=first.past_key_values,
                                      attention_mask=torch.ones_like(first.sequences),
                                      max_new_tokens=self.max_new_tokens - 1, do_sample=False,
                                      return_dict_in_generate=True, output_logits=True)
            self.assertTrue(torch.equal(rest.sequences, whole.sequences))
            torch.testing.assert_close(torch.stack(first.logits + rest.logits), torch.stack(whole.logits),
                                       atol=ATOL, rtol=0)

    def test_generate_with_static_cache(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self._generation_inputs()
            model = self._model(model_class, config)
            kwargs = dict(return_dict_in_generate=True, output_logits=True)
            dynamic = self._greedy(model, inputs, **kwargs)
            static = self._greedy(model, inputs, cache_implementation="static", **kwargs)
            self.assertTrue(torch.equal(static.sequences, dynamic.sequences))
            torch.testing.assert_close(torch.stack(static.logits), torch.stack(dynamic.logits), atol=ATOL, rtol=0)
            # the fixed-size cache: room for the prompt (media rows included) and the new tokens
            self.assertIsNotNone(static.past_key_values.max_length)
            self.assertGreaterEqual(static.past_key_values.max_length, static.past_key_values.seen_tokens)

    def test_assisted_decoding_matches_greedy_search(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self._generation_inputs(batch_size=1)
            model = self._model(model_class, config)
            greedy = self._greedy(model, inputs)
            assistant = self._model(model_class, config)  # the same weights: every candidate is accepted
            assisted = self._greedy(model, inputs, assistant_model=assistant)
            lookup = self._greedy(model, inputs, prompt_lookup_num_tokens=2)
            self.assertTrue(torch.equal(assisted, greedy))
            self.assertTrue(torch.equal(lookup, greedy))

    def test_generate_methods_with_logits_to_keep(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self._generation_inputs()
            model = self._model(model_class, config)
            with torch.no_grad():
                full = model(**inputs, use_cache=False).logits
                last = model(**inputs, use_cache=False, logits_to_keep=1).logits
            torch.testing.assert_close(last, full[:, -1:], atol=1e-6, rtol=0)
            self.assertTrue(torch.equal(self._greedy(model, inputs, logits_to_keep=1), self._greedy(model, inputs)))
