"""The K3-format tokenizer of kimi-k3-mini, trained on the corpus.

A byte-level BPE with K3's split regex (`special_tokens.PAT_STR`) is trained with the `tokenizers` library; its
merges become tiktoken ranks (the 256 bytes at ranks 0..255 in byte order, then each merged token at 256 + its merge
index, so every token's two halves rank below it). The ranks go through the package's `write_kimi3_tokenizer`:
`tiktoken.model`, the converted `tokenizer.json`, `tokenizer_config.json` with the released K3 special-token block
(256 ids after the ranks, `[BOS]` at +0, `<|end_of_msg|>` at +2, `<|media_pad|>` at +21, `[UNK]` / `[PAD]` at
+254 / +255) and the K3 chat template. The folder loads with `AutoTokenizer` (no tiktoken needed) and with
`Kimi3Tokenizer` (tiktoken).
"""

import os

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from transformers_kimi3.special_tokens import (
    BYTE_DECODER,
    CHAT_TEMPLATE,
    K3_SPECIAL_TOKEN_OFFSETS,
    NUM_RESERVED_SPECIAL_TOKENS,
    PAT_STR,
)
from transformers_kimi3.tokenization_kimi3 import special_token_slots, write_kimi3_tokenizer


def _bpe_trainer_backend():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def _as_bytes(token):
    return bytes(BYTE_DECODER[c] for c in token)


def train_ranks(texts, num_ranks, min_frequency=2):
    """tiktoken ranks {token bytes: rank} with `num_ranks` entries (256 bytes + merges) learnt from `texts`."""
    if num_ranks <= 256:
        raise ValueError(f"num_ranks must exceed the 256 byte tokens, got {num_ranks}")
    tok = _bpe_trainer_backend()
    trainer = trainers.BpeTrainer(vocab_size=num_ranks, min_frequency=min_frequency, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    ranks = {bytes([b]): b for b in range(256)}
    for left, right in tok.model.get_merges() if hasattr(tok.model, "get_merges") else _merges_of(tok):
        token = _as_bytes(left) + _as_bytes(right)
        if token not in ranks:
            ranks[token] = len(ranks)
        if len(ranks) == num_ranks:
            break
    return ranks


def _merges_of(tok):
    import json

    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


def k3_named_tokens(num_reserved):
    return {name for offset, (name, _) in K3_SPECIAL_TOKEN_OFFSETS.items() if offset < num_reserved}


def build_tokenizer(out_dir, texts, vocab_size, num_reserved=NUM_RESERVED_SPECIAL_TOKENS):
    """Train on `texts` and write a K3 tokenizer folder of `vocab_size` ids (`vocab_size - num_reserved` ranks).
    Returns the id map: vocab_size, num_ranks, bos/eos (`<|end_of_msg|>`)/pad/media/eos_text ids."""
    num_ranks = vocab_size - num_reserved
    ranks = train_ranks(texts, num_ranks)
    if len(ranks) != num_ranks:
        raise ValueError(f"the corpus gave only {len(ranks)} ranks; ask for a vocab_size of at most "
                         f"{len(ranks) + num_reserved}")
    slots = special_token_slots(num_ranks, None, num_reserved)
    os.makedirs(out_dir, exist_ok=True)
    write_kimi3_tokenizer(out_dir, ranks, slots, named=k3_named_tokens(num_reserved), chat_template=CHAT_TEMPLATE)
    return token_ids(num_ranks)


def token_ids(num_ranks, num_reserved=NUM_RESERVED_SPECIAL_TOKENS):
    ids = {name: num_ranks + offset for offset, (name, _) in K3_SPECIAL_TOKEN_OFFSETS.items()
           if offset < num_reserved}
    return {"vocab_size": num_ranks + num_reserved, "num_ranks": num_ranks, "bos_token_id": ids["[BOS]"],
            "eos_token_id": ids["<|end_of_msg|>"], "eos_text_token_id": ids["[EOS]"], "pad_token_id": ids["[PAD]"],
            "media_placeholder_token_id": ids["<|media_pad|>"]}
