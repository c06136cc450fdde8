"""Token files and packed rows for the text phase of kimi-k3-mini.

`encode_corpus` turns `corpus.jsonl` into two flat token files per split: `text_{split}.bin` (uint16 ids, every
document followed by `[EOS]`) and `text_{split}_offsets.npy` (int64, document starts plus the end). `PackedRows`
cuts the documents into chunks of at most `seq_len` tokens, shuffles the chunks with the seed and packs them into
rows of at most `seq_len` tokens (first fit over the last few open rows). `PackedRowCollator` flattens a batch of
rows into one padding-free row with the package's `packed_collator`: position ids restart at every document, the
first label of each document is -100, so no document sees or predicts another.
"""

import json
import os
import random

import numpy as np
import torch

from transformers_kimi3.training import packed_collator


def encode_corpus(tokenizer, corpus, out_dir, eos_id, batch=512):
    """Write the token files of both splits; returns {split: tokens}. `corpus` is a list of documents."""
    os.makedirs(out_dir, exist_ok=True)
    backend = tokenizer.backend_tokenizer
    counts = {}
    for split in ("train", "eval"):
        texts = [d["text"] for d in corpus if d["split"] == split]
        lengths, parts = [0], []
        for start in range(0, len(texts), batch):
            for enc in backend.encode_batch(texts[start:start + batch], add_special_tokens=False):
                parts.append(np.asarray(enc.ids + [eos_id], dtype=np.uint16))
                lengths.append(len(enc.ids) + 1)
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.uint16)
        tokens.tofile(os.path.join(out_dir, f"text_{split}.bin"))
        np.save(os.path.join(out_dir, f"text_{split}_offsets.npy"), np.cumsum(lengths, dtype=np.int64))
        counts[split] = int(tokens.size)
    with open(os.path.join(out_dir, "tokens.json"), "w") as f:
        json.dump(counts, f, indent=2)
    return counts


def load_split(data_dir, split):
    tokens = np.fromfile(os.path.join(data_dir, f"text_{split}.bin"), dtype=np.uint16)
    offsets = np.load(os.path.join(data_dir, f"text_{split}_offsets.npy"))
    return tokens, offsets


def chunk_spans(offsets, seq_len):
    """[(start, end)] token spans: every document cut into pieces of at most `seq_len` tokens (pieces under 8
    tokens, which teach nothing, are dropped)."""
    spans = []
    for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        for s in range(start, end, seq_len):
            if min(end, s + seq_len) - s >= 8:
                spans.append((s, min(end, s + seq_len)))
    return spans


def pack_rows(spans, seq_len, seed, open_rows=8):
    """Shuffle the spans with `seed`, then first-fit them into rows of at most `seq_len` tokens, looking at the last
    `open_rows` rows. Deterministic for a seed."""
    order = list(range(len(spans)))
    random.Random(seed).shuffle(order)
    rows, room = [], []
    for i in order:
        n = spans[i][1] - spans[i][0]
        for r in range(max(0, len(rows) - open_rows), len(rows)):
            if room[r] >= n:
                rows[r].append(spans[i])
                room[r] -= n
                break
        else:
            rows.append([spans[i]])
            room.append(seq_len - n)
    return rows


class PackedRows(torch.utils.data.Dataset):
    """Rows of packed document chunks of one split; item i = {"docs": [token lists]}."""

    def __init__(self, data_dir, split, seq_len, seed, max_rows=None):
        self.tokens, offsets = load_split(data_dir, split)
        self.rows = pack_rows(chunk_spans(offsets, seq_len), seq_len, seed)
        if max_rows is not None:
            self.rows = self.rows[:max_rows]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"docs": [self.tokens[s:e].astype(np.int64).tolist() for s, e in self.rows[i]]}

    def num_tokens(self):
        return sum(e - s for row in self.rows for s, e in row)


class PackedRowCollator:
    """A batch of packed rows -> one padding-free row (`input_ids`, `labels`, `position_ids`, each [1, N])."""

    def __init__(self):
        self.flatten = packed_collator(return_tensors="pt")

    def __call__(self, rows):
        return self.flatten([{"input_ids": doc} for row in rows for doc in row["docs"]])
