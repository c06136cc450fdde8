"""A small K3-format tokenizer for tests and the bundled tiny demo checkpoint.

:func:`build_tiny_tokenizer` trains, deterministically and without any download, a byte-level BPE on a built-in
text with K3's split regex, then lays out the ids exactly like the released K3 tokenizer: the 256 byte tokens and
the merges first (``tiktoken.model``), then a block of special ids whose first 22 offsets hold the same names as
K3's (``[BOS]`` at +0, ``<|end_of_msg|>`` at +2, ``<|media_pad|>`` at +21, ...) and whose last ids are ``[UNK]``
and ``[PAD]``. With the default ``vocab_size=512`` (448 ranks + 64 special ids) the ids are bos 448,
eos (``<|end_of_msg|>``) 450, media 469, pad 511 -- the ids of the ``oracle/A`` test checkpoint.
"""

from __future__ import annotations

import os
from collections import Counter

from tokenizers import AddedToken, Regex, pre_tokenizers

from .special_tokens import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    CLOSE_TOKEN,
    END_OF_MSG_TOKEN,
    EOS_TOKEN,
    K3_SPECIAL_TOKEN_OFFSETS,
    MEDIA_BEGIN_TOKEN,
    MEDIA_CONTENT_TOKEN,
    MEDIA_END_TOKEN,
    MEDIA_PAD_TOKEN,
    OPEN_TOKEN,
    OSAGENT_MODE_TOKEN,
    PAD_TOKEN,
    PAT_STR,
    SEP_TOKEN,
    UNK_TOKEN,
    reserved_token_name,
)
from .tokenization_kimi3 import write_kimi3_tokenizer


TINY_NUM_SPECIAL_TOKENS = 64

# offset inside the special block -> (name, special): K3's offsets 0..21, then the names K3 puts at +65, +254 and
# +255 on the last three ids of the smaller block
TINY_SPECIAL_TOKEN_OFFSETS = {
    **{offset: entry for offset, entry in K3_SPECIAL_TOKEN_OFFSETS.items() if offset < 22},
    TINY_NUM_SPECIAL_TOKENS - 3: (OSAGENT_MODE_TOKEN, True),
    TINY_NUM_SPECIAL_TOKENS - 2: (UNK_TOKEN, True),
    TINY_NUM_SPECIAL_TOKENS - 1: (PAD_TOKEN, True),
}

# Training text: written for this file; English prose, code, numbers, Chinese, the words of the chat format.
_TRAINING_TEXT = """
The quick brown fox jumps over the lazy dog. A tiny model still needs a tokenizer that behaves like the real one:
the same byte-level alphabet, the same way of cutting text into words, numbers and punctuation, the same special
tokens at the top of the vocabulary. This text is what the tiny tokenizer learns its merges from.
Kimi is a helpful assistant. The user asks a question, the assistant thinks, then answers. Sometimes the assistant
calls a tool, reads the result, and answers again. Images arrive as one placeholder each; the model expands them.
What is in this image? It is a cat sitting on a red chair next to the window. The weather today is sunny and warm.
Please describe the picture in detail. There are two people, three dogs and a small boat on the river.
message role user assistant system tool think response tools call argument json type key index name string number
boolean object array null true false image media begin content end pad open close sep of msg reasoning answer
The answer is 42. The year 2026 has 365 days; 12 months; 7 days a week; 24 hours a day; 60 minutes an hour.
Prices: 19.99, 5.00, 1000, 3.14159, 2.71828, 1,234,567 and 0.5 percent. Call 555-0100 before 9:30 am.
def add(a, b):
    return a + b

for i in range(10):
    print(f"value {i}: {add(i, i)}")

class Model:
    def __init__(self, hidden_size=128, num_layers=8):
        self.hidden_size = hidden_size
        self.num_layers = num_layers

    def forward(self, input_ids, attention_mask=None):
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=attention_mask)
        return self.norm(hidden)

if __name__ == "__main__":
    model = Model()
    print(model.forward([1, 2, 3]))
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": {}}}
人工智能正在改变世界。今天天气很好，我们去公园散步吧。请描述这张图片。这是一只猫。
你好，世界！我是一个有用的助手。模型会先思考，然后回答问题。
The rain in Spain stays mainly in the plain. She sells sea shells by the sea shore. Peter Piper picked a peck.
HTTP requests, JSON responses, URLs like https://example.com/path?query=value&page=2 and emails like a@b.org.
Don't, won't, can't, it's, we're, they've, I'm, you'll, he'd. THE END. The End. the end.
Numbers and units: 128 tokens, 512 ids, 1024 bytes, 64 special tokens, 14 pixels, 28 pixels, 56 by 84.
Emoji and symbols: 🙂 🎉 ✓ → ← ± × ÷ € £ ¥ © ® ™ • … — –
Other scripts: Καλημέρα κόσμε. Привет, мир! مرحبا بالعالم. こんにちは世界。안녕하세요 세계.
"""


def _train_merges(text: str, num_merges: int) -> list[bytes]:
    """Byte-level BPE training: most frequent adjacent pair first, ties broken by the smaller (left, right) rank
    pair; returns the merged tokens in rank order. Fully deterministic."""
    splitter = pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated")
    word_counts = Counter(piece.encode("utf-8") for piece, _ in splitter.pre_tokenize_str(text))
    rank = {bytes([b]): b for b in range(256)}
    words = [([bytes([b]) for b in word], count) for word, count in sorted(word_counts.items())]
    merged: list[bytes] = []
    while len(merged) < num_merges:
        pairs: Counter = Counter()
        for symbols, count in words:
            for a, b in zip(symbols, symbols[1:]):
                pairs[(a, b)] += count
        candidates = [(pair, n) for pair, n in pairs.items() if pair[0] + pair[1] not in rank]
        if not candidates:
            raise ValueError(
                f"the built-in training text only supports {len(merged)} merges; ask for a smaller vocab_size"
            )
        (a, b), _ = min(candidates, key=lambda item: (-item[1], rank[item[0][0]], rank[item[0][1]]))
        new = a + b
        rank[new] = 256 + len(merged)
        merged.append(new)
        for symbols, _count in words:
            i = 0
            while i < len(symbols) - 1:
                if symbols[i] == a and symbols[i + 1] == b:
                    symbols[i : i + 2] = [new]
                i += 1
    return merged


def tiny_special_tokens(num_base_tokens: int) -> dict[int, AddedToken]:
    slots = {}
    for offset in range(TINY_NUM_SPECIAL_TOKENS):
        index = num_base_tokens + offset
        name, special = TINY_SPECIAL_TOKEN_OFFSETS.get(offset, (reserved_token_name(index), True))
        slots[index] = AddedToken(name, special=special, normalized=False)
    return slots


def build_tiny_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 512) -> dict:
    """Write a small K3-format tokenizer to ``out_dir`` and return its ids.

    Files: ``tiktoken.model`` (256 byte tokens + ``vocab_size - 320`` merges), ``tokenizer_config.json`` (named
    special tokens in ``added_tokens_decoder``, ``num_reserved_special_tokens`` = 64), ``special_tokens_map.json``,
    ``tokenizer.json`` (the converted fast tokenizer) and ``chat_template.jinja``.
    ``AutoTokenizer.from_pretrained(out_dir)`` loads it without remote code; ``Kimi3Tokenizer.from_pretrained(out_dir)`` gives the tiktoken path.

    Args:
        out_dir: folder to write (created if needed).
        vocab_size: total number of ids, a multiple of 64 between 384 and 1024.

    Returns:
        dict with ``vocab_size``, ``num_base_tokens``, ``bos_token_id``, ``eos_token_id`` (= ``<|end_of_msg|>``, the
        stop token), ``pad_token_id``, ``unk_token_id``, ``media_placeholder_token_id`` (``<|media_pad|>``),
        ``end_of_msg_token_id``, ``eos_text_token_id`` (``[EOS]``), ``open_token_id``, ``close_token_id``,
        ``sep_token_id``, ``media_begin_token_id``, ``media_content_token_id``, ``media_end_token_id`` and
        ``special_tokens`` (name -> id for every named special token).
    """
    if not isinstance(vocab_size, int) or vocab_size % 64 or not 384 <= vocab_size <= 1024:
        raise ValueError(f"vocab_size must be a multiple of 64 between 384 and 1024, got {vocab_size!r}")
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    num_base = vocab_size - TINY_NUM_SPECIAL_TOKENS
    merges = _train_merges(_TRAINING_TEXT, num_base - 256)
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({token: 256 + i for i, token in enumerate(merges)})
    slots = tiny_special_tokens(num_base)
    named = {name for name, _ in TINY_SPECIAL_TOKEN_OFFSETS.values()}
    write_kimi3_tokenizer(out_dir, ranks, slots, named=named, chat_template=CHAT_TEMPLATE)

    ids = {tok.content: index for index, tok in slots.items() if tok.content in named}
    return {
        "vocab_size": vocab_size,
        "num_base_tokens": num_base,
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[END_OF_MSG_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
        "unk_token_id": ids[UNK_TOKEN],
        "media_placeholder_token_id": ids[MEDIA_PAD_TOKEN],
        "end_of_msg_token_id": ids[END_OF_MSG_TOKEN],
        "eos_text_token_id": ids[EOS_TOKEN],
        "open_token_id": ids[OPEN_TOKEN],
        "close_token_id": ids[CLOSE_TOKEN],
        "sep_token_id": ids[SEP_TOKEN],
        "media_begin_token_id": ids[MEDIA_BEGIN_TOKEN],
        "media_content_token_id": ids[MEDIA_CONTENT_TOKEN],
        "media_end_token_id": ids[MEDIA_END_TOKEN],
        "special_tokens": ids,
    }


__all__ = ["TINY_SPECIAL_TOKEN_OFFSETS", "build_tiny_tokenizer", "tiny_special_tokens"]
