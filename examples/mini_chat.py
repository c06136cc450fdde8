"""Conversations in the K3 chat format for the vision and chat phases of kimi-k3-mini, and their encoding.

Conversations come from the same sources as the text: questions on standard-library APIs answered from their
docstrings, questions on documentation sections answered from their first paragraph, one tool-call pattern (the
assistant calls `python_docs`, reads the result, answers), the synthetic pictures of `mini_vision`, and a few
greetings. Thinking is on for part of them (a short `reasoning_content`) and off for the rest; some carry a system
prompt. `encode_conversation` renders them with the K3 chat template through the processor, writes each image's
size into its media block as the processor does, and labels exactly the assistant turns (from the generation prompt
to `<|end_of_msg|>`); everything else is -100. Conversations come from training documents only; a phase's held-out
set takes its document pieces ("text" items) from the held-out split.
"""

import re

import torch

from mini_vision import item_rng, scene_example
from transformers_kimi3.special_tokens import MEDIA_BEGIN_TOKEN, MEDIA_CONTENT_TOKEN, MEDIA_PAD_TOKEN

SYSTEM_PROMPTS = (None, None, "You are Kimi, a helpful assistant.", "You are a concise documentation assistant.",
                  "Answer in one or two sentences.")
DOC_TOOL = {"type": "function", "function": {
    "name": "python_docs", "description": "Return the documentation of a Python standard library object.",
    "parameters": {"type": "object", "properties": {"name": {"type": "string", "description": "dotted name"}},
                   "required": ["name"]}}}
SMALL_TALK = (
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi, who are you?", "I am kimi-k3-mini, a small Kimi K3 model trained on open software documentation and "
                         "synthetic pictures."),
    ("What can you do?", "I can answer short questions about Python, Django, SQLAlchemy, PostgreSQL and SQLite, and "
                         "describe simple pictures of shapes, digits and letters."),
    ("Thank you!", "You are welcome."),
    ("Can you see images?", "Yes. Show me a picture and ask about its shapes, colours, counts or positions."),
)
_MEDIA_BLOCK = f"{MEDIA_BEGIN_TOKEN}image{MEDIA_CONTENT_TOKEN}{MEDIA_PAD_TOKEN}"


def first_paragraph(text, max_words=60):
    """The first paragraph, cut after the last full sentence within `max_words` words."""
    para = " ".join(text.strip().split("\n\n")[0].split())
    words = para.split()
    if len(words) <= max_words:
        return para
    cut = " ".join(words[:max_words])
    end = cut.rfind(". ")
    return cut[:end + 1] if end > 40 else cut + "..."


def first_sentence(text):
    para = first_paragraph(text)
    m = re.search(r"(?<=[.!?])\s", para)
    return para[:m.start()] if m else para


def usable_records(records):
    """The API records whose docstring says something (six words or more)."""
    return [r for r in records if len(r["doc"].split()) >= 6]


def usable_sections(corpus):
    """[{"title", "text"}]: titled training sections (not docstrings) whose first paragraph is a full answer."""
    out = []
    for doc in corpus:
        title = doc.get("title") or ""
        if doc["split"] != "train" or not 2 <= len(title.split()) <= 8 or doc["source"] == "stdlib-docstrings":
            continue
        body = doc["text"].split("\n\n", 1)[-1]
        answer = first_paragraph(body)
        if len(answer.split()) >= 12 and answer.endswith("."):
            out.append({"title": title[:1].lower() + title[1:] if title.startswith("The ") else title, "text": answer})
    return out


# ----------------------------------------------------------------------------- conversations
def _user(text, image=False):
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}] if image else text}


def _assistant(text, thinking=None):
    msg = {"role": "assistant", "content": text}
    if thinking:
        msg["reasoning_content"] = thinking
    return msg


def api_conversation(rec, rng, thinking):
    name = rec["name"]
    question, answer = rng.choice((
        (f"What does {name} do?", first_paragraph(rec["doc"])),
        (f"Explain {name} briefly.", first_sentence(rec["doc"])),
        (f"What is the signature of {name}?", f"{rec['signature']}: {first_sentence(rec['doc'])}"),
    ))
    think = f"The user asks about {name}, a {rec['kind']} of the standard library." if thinking else None
    return [_user(question), _assistant(answer, think)], None


def section_conversation(sec, rng, thinking):
    question = rng.choice((f"What is \"{sec['title']}\" about?", f"Tell me about {sec['title']}.",
                           f"Explain {sec['title']}."))
    think = f"This is about {sec['title']}. A short summary answers it." if thinking else None
    return [_user(question), _assistant(first_paragraph(sec["text"]), think)], None


def tool_conversation(rec, rng, thinking):
    name = rec["name"]
    call = {"type": "function", "function": {"name": "python_docs", "arguments": {"name": name}}}
    think = f"I should look up {name} with the documentation tool." if thinking else None
    return [_user(rng.choice((f"Look up the documentation of {name}.", f"Use the docs tool: what is {name}?"))),
            {"role": "assistant", "content": "", "tool_calls": [call], **({"reasoning_content": think} if think
                                                                            else {})},
            {"role": "tool", "content": first_paragraph(rec["doc"]), "tool_call_id": "1"},
            _assistant(f"According to the documentation, {name}: {first_sentence(rec['doc'])}")], [DOC_TOOL]


def vision_conversation(seed, index, thinking):
    image, question, answer = scene_example(seed, index)
    think = "I look at the shapes, their colours and where they are." if thinking else None
    return [_user(question, image=True), _assistant(answer, think)], image


def with_system(messages, rng):
    system = rng.choice(SYSTEM_PROMPTS)
    return ([{"role": "system", "content": system}] if system else []) + messages


# ----------------------------------------------------------------------------- encoding
def render(processor, messages, tools, thinking, generation_prompt=False):
    return processor.apply_chat_template(messages, tools=tools, thinking=thinking, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def assistant_spans(processor, messages, tools, thinking, images=()):
    """(text, [(start, end)]): the rendered conversation, with each image's size written into its media block, and
    the character spans of its assistant turns."""
    def text_of(msgs, generation_prompt=False):
        text = render(processor, msgs, tools, thinking, generation_prompt)
        return _with_image_sizes(text, images[:text.count(_MEDIA_BLOCK)])

    spans = []
    for j, msg in enumerate(messages):
        if msg["role"] == "assistant":
            spans.append((len(text_of(messages[:j], True)), len(text_of(messages[:j + 1]))))
    return text_of(messages), spans


def _with_image_sizes(text, images):
    """Write "WxH" into each media block, as Kimi3Processor does."""
    parts = text.split(_MEDIA_BLOCK)
    if len(parts) - 1 != len(images):
        raise ValueError(f"{len(parts) - 1} media blocks for {len(images)} images")
    out = parts[0]
    for image, part in zip(images, parts[1:]):
        out += f"{MEDIA_BEGIN_TOKEN}image {image.width}x{image.height}{MEDIA_CONTENT_TOKEN}{MEDIA_PAD_TOKEN}" + part
    return out


def encode_conversation(processor, messages, tools=None, thinking=False, images=(), max_len=1024):
    """{"input_ids", "labels"[, "pixel_values", "grid_thws"]}: labels on the assistant turns only."""
    images = list(images)
    text, spans = assistant_spans(processor, messages, tools, thinking, images)
    enc = processor.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"][:max_len]
    labels = [tok if any(s <= a < e for s, e in spans) else -100
              for tok, (a, _) in zip(ids, enc["offset_mapping"][:max_len])]
    out = {"input_ids": ids, "labels": labels}
    if images:
        pixels = processor.image_processor(images, return_tensors="pt")
        out.update(pixel_values=pixels["pixel_values"], grid_thws=pixels["grid_thws"])
    return out


class PaddedCollator:
    """Right-pads `input_ids` / `labels`, builds `attention_mask`, concatenates the images' patches and grids."""

    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, items):
        width = max(len(x["input_ids"]) for x in items)
        batch = {
            "input_ids": torch.tensor([x["input_ids"] + [self.pad_id] * (width - len(x["input_ids"])) for x in items]),
            "labels": torch.tensor([x["labels"] + [-100] * (width - len(x["labels"])) for x in items]),
            "attention_mask": torch.tensor([[1] * len(x["input_ids"]) + [0] * (width - len(x["input_ids"]))
                                            for x in items]),
        }
        with_images = [x for x in items if "pixel_values" in x]
        if with_images:
            batch["pixel_values"] = torch.cat([x["pixel_values"] for x in with_images])
            batch["grid_thws"] = torch.cat([x["grid_thws"] for x in with_images])
        return batch


# ----------------------------------------------------------------------------- datasets
class ChatData(torch.utils.data.Dataset):
    """`size` conversations; item i is drawn from a generator seeded with (seed, i). `mix` weighs the kinds
    ("vision", "api", "section", "tool", "talk", "text"); `thinking` is the share with thinking on. A "text" item is
    no conversation: a piece of a training document (`text`: (tokens, [(start, end)] spans), every token labelled),
    so that the phases after the text phase keep the language model's perplexity."""

    def __init__(self, processor, seed, size, mix, records=(), sections=(), thinking=0.4, max_len=1024, text=None):
        self.processor, self.seed, self.size, self.max_len = processor, seed, size, max_len
        self.kinds, self.weights = zip(*sorted(mix.items()))
        self.records, self.sections, self.thinking = list(records), list(sections), thinking
        if "text" in self.kinds and text is None:
            raise ValueError("a mix with 'text' items needs `text`: (tokens, spans) of the training split")
        self.text = text

    def __len__(self):
        return self.size

    def conversation(self, i):
        """(messages, tools, thinking, images) of item i."""
        rng = item_rng(self.seed, i, salt=1)
        kind = rng.choices(self.kinds, self.weights)[0]
        thinking = rng.random() < self.thinking
        tools, images = None, []
        if kind == "vision":
            messages, image = vision_conversation(self.seed, i, thinking)
            images = [image]
        elif kind == "api" and self.records:
            messages, tools = api_conversation(rng.choice(self.records), rng, thinking)
        elif kind == "tool" and self.records:
            messages, tools = tool_conversation(rng.choice(self.records), rng, thinking)
        elif kind == "section" and self.sections:
            messages, tools = section_conversation(rng.choice(self.sections), rng, thinking)
        else:
            question, answer = rng.choice(SMALL_TALK)
            messages = [_user(question), _assistant(answer, "A short friendly answer." if thinking else None)]
        return with_system(messages, rng), tools, thinking, images

    def __getitem__(self, i):
        rng = item_rng(self.seed, i, salt=1)  # the same first draw as `conversation(i)`: the item's kind
        if rng.choices(self.kinds, self.weights)[0] == "text":
            tokens, spans = self.text
            start, end = rng.choice(spans)
            ids = tokens[start:end].astype("int64").tolist()[:self.max_len]
            return {"input_ids": ids, "labels": list(ids)}
        messages, tools, thinking, images = self.conversation(i)
        return encode_conversation(self.processor, messages, tools, thinking, images, self.max_len)
