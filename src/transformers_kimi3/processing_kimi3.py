"""Kimi K3 processor, the XTML chat format and its output parser.

K3's chat format is "XTML": tags written with three markers, ``<|open|>name attr="v"<|sep|>`` ...
``<|close|>name<|sep|>``, and every message ends with ``<|end_of_msg|>`` (the generation stop token)::

    <|open|>message role="system"<|sep|>You are Kimi.<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="user"<|sep|><|media_begin|>image 640x480<|media_content|><|media_pad|><|media_end|>What is this?<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|><|open|>think<|sep|>...reasoning...<|close|>think<|sep|><|open|>response<|sep|>A cat.<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="tool" tool="get_weather" index="1"<|sep|>sunny<|close|>message<|sep|><|end_of_msg|>

The generation prompt opens an assistant message and its ``think`` channel (``response`` with thinking off). Tools
are declared in a leading system message (``type="tool-declare"``, compact JSON schema) and, with thinking on, a
``type="thinking-effort"`` system note (default ``max``) precedes the conversation, as in Moonshot's
``encoding_k3.py``. An image is one ``<|media_pad|>`` inside ``<|media_begin|>image WxH<|media_content|>`` ...
``<|media_end|>`` (W x H: the original pixel size, filled in by the processor); the model expands the pad to
``h * w / 4`` features.

Template variables (``apply_chat_template(..., name=value)``): ``thinking`` (or ``enable_thinking``; default true),
``thinking_effort`` ("low" | "high" | "max" | None; default "max"), ``tool_choice`` ("auto" | "required" | "none"),
``response_format`` ({"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema":
...}}). ``tools`` are ``{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}``
(or Python functions, which Transformers turns into that); ``description`` and ``parameters`` are optional. The
template refuses, with a ``jinja2.TemplateError`` naming the argument and field, a tool whose ``function`` is not
an object with a non-empty string ``name`` (and, where given, a string ``description`` and an object
``parameters``), and any other ``tool_choice``, ``response_format`` or ``thinking_effort`` value; that includes a
``tool_choice`` dict naming one tool, which the format cannot express.
``apply_chat_template(..., sanitize_control_tokens=True)`` makes the control tokens found in the inputs plain text;
Transformers releases that lack the option (5.17) pass it to the template, which then breaks those tokens with a
zero-width space (U+200B after their first character) so that they still cannot act as control tokens.
The template itself is :data:`special_tokens.CHAT_TEMPLATE`.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from transformers.feature_extraction_utils import BatchFeature
from transformers.processing_utils import ProcessorMixin, TextKwargs
from transformers.utils import logging

from .special_tokens import (
    CHAT_TEMPLATE,
    CLOSE_TOKEN,
    END_OF_MSG_TOKEN,
    IMAGE_PROMPT,
    KIMI_IMAGE_PLACEHOLDER,
    MEDIA_BEGIN_TOKEN,
    MEDIA_CONTENT_TOKEN,
    MEDIA_PAD_TOKEN,
    OPEN_TOKEN,
    SEP_TOKEN,
    save_tiktoken_ranks,
    tiktoken_ranks_from_fast,
)

try:
    from PIL import Image
except ImportError:  # pillow is optional: only needed to read the size of file/bytes images
    Image = None


logger = logging.get_logger(__name__)

# ----------------------------------------------------------------------------------------------------------------
# output parser
# ----------------------------------------------------------------------------------------------------------------
_EVENT_RE = re.compile(
    re.escape(OPEN_TOKEN) + r"(.*?)" + re.escape(SEP_TOKEN)
    + "|" + re.escape(CLOSE_TOKEN) + r"(.*?)" + re.escape(SEP_TOKEN)
    + "|" + re.escape(END_OF_MSG_TOKEN),
    re.DOTALL,
)
_ATTR_RE = re.compile(r'([A-Za-z_][\w-]*)="([^"]*)"')


def _unescape_attr(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def _parse_tag(raw: str) -> tuple[str, dict[str, str]]:
    raw = raw.strip()
    name, _, rest = raw.partition(" ")
    return name, {k: _unescape_attr(v) for k, v in _ATTR_RE.findall(rest)}


def _argument_value(raw: str, xtml_type: str | None):
    if xtml_type in (None, "string"):
        return raw
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, ValueError):
        return raw


def _open_channel_at_end(prompt: str) -> str | None:
    """The text channel (think / response) a prompt leaves open, if any."""
    channel = None
    for m in _EVENT_RE.finditer(prompt):
        if m.group(1) is not None:
            name, _ = _parse_tag(m.group(1))
            channel = name if name in ("think", "response") else None
        else:
            channel = None
    return channel


def parse_kimi3_output(text: str, start_channel: str | None = None, prefix: str | None = None) -> dict[str, Any]:
    """Split K3 output into ``{"reasoning": str | None, "content": str, "tool_calls": [{"name", "arguments"}]}``.

    ``text`` is what the model generated after the generation prompt (which ends inside the ``think`` channel, or
    the ``response`` channel with thinking off), decoded with or without special tokens (the XTML markers are not
    special, so ``skip_special_tokens=True`` keeps them); a whole rendered assistant message (starting with
    ``<|open|>message role="assistant"<|sep|>``) works too. ``start_channel`` ("think" / "response") says which
    channel the text starts in when it does not open one itself. ``prefix`` (the prompt, e.g. the decoded input ids)
    tells it instead: the channel the prompt leaves open. Without either it is inferred (text that closes a
    ``think`` channel it never opened started in it, otherwise it is response text).

    Argument values are typed by their ``type`` attribute (``string`` stays text, others are JSON); a ``json`` block
    is parsed into the arguments dict when it is a JSON object. Text truncated mid-way yields what was complete.
    A text without any marker is all content.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_kimi3_output expects a str, got {type(text).__name__}")
    events = list(_EVENT_RE.finditer(text))
    if start_channel is None and prefix:
        start_channel = _open_channel_at_end(prefix)
    if start_channel is None:
        start_channel = "response"
        for m in events:
            if m.group(1) is not None:
                name, _ = _parse_tag(m.group(1))
                if name in ("think", "response", "message"):
                    break
            elif m.group(2) is not None and m.group(2).strip() == "think":
                start_channel = "think"
                break
    elif start_channel not in ("think", "response"):
        raise ValueError(f"start_channel must be 'think', 'response' or None, got {start_channel!r}")

    reasoning_parts: list[str] | None = None
    content_parts: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    channel = start_channel  # think | response | tools | call | argument | json | None (between channels)
    if channel == "think":
        reasoning_parts = []
    current_call: dict[str, Any] | None = None
    current_arg: tuple[str, str | None] | None = None
    buffer: list[str] = []

    def flush_text(chunk: str):
        if not chunk:
            return
        if channel == "think":
            reasoning_parts.append(chunk)
        elif channel == "response":
            content_parts.append(chunk)
        elif channel in ("argument", "json"):
            buffer.append(chunk)
        # text between tags in other places (stray whitespace) is dropped

    def close_call():
        nonlocal current_call
        if current_call is not None:
            tool_calls.append(current_call)
            current_call = None

    pos = 0
    finished = False
    for m in events:
        flush_text(text[pos : m.start()])
        pos = m.end()
        if m.group(1) is not None:  # <|open|>name attrs<|sep|>
            name, attrs = _parse_tag(m.group(1))
            if name == "message":
                channel = None
            elif name == "think":
                channel = "think"
                if reasoning_parts is None:
                    reasoning_parts = []
            elif name == "response":
                channel = "response"
            elif name == "tools":
                channel = "tools"
            elif name == "call":
                close_call()
                current_call = {"name": attrs.get("tool", ""), "arguments": {}}
                channel = "call"
            elif name == "argument":
                current_arg = (attrs.get("key", ""), attrs.get("type"))
                buffer = []
                channel = "argument"
            elif name == "json":
                buffer = []
                channel = "json"
            else:  # an unknown tag inside a text channel is text
                flush_text(m.group(0))
        elif m.group(2) is not None:  # <|close|>name<|sep|>
            name = m.group(2).strip()
            if name == "argument" and channel == "argument":
                if current_call is not None and current_arg is not None:
                    current_call["arguments"][current_arg[0]] = _argument_value("".join(buffer), current_arg[1])
                current_arg, buffer = None, []
                channel = "call"
            elif name == "json" and channel == "json":
                raw = "".join(buffer)
                buffer = []
                if current_call is not None:
                    try:
                        value = json.loads(raw)
                    except (json.JSONDecodeError, ValueError):
                        value = raw
                    if isinstance(value, dict):
                        current_call["arguments"].update(value)
                    else:
                        current_call["arguments"] = raw
                channel = "call"
            elif name == "call":
                close_call()
                channel = "tools"
            elif name in ("think", "response", "tools"):
                channel = None
            elif name == "message":
                finished = True
                break
            else:
                flush_text(m.group(0))
        else:  # <|end_of_msg|>
            finished = True
            break
    if not finished:
        flush_text(text[pos:])
        if channel == "argument" and current_call is not None and current_arg is not None:
            current_call["arguments"][current_arg[0]] = _argument_value("".join(buffer), current_arg[1])
    close_call()

    reasoning = "".join(reasoning_parts) if reasoning_parts is not None else None
    return {"reasoning": reasoning or None, "content": "".join(content_parts), "tool_calls": tool_calls}


def kimi3_output_to_message(parsed_or_text: dict | str) -> dict[str, Any]:
    """An assistant message in Transformers' chat format (``content``, ``reasoning_content``, OpenAI-style
    ``tool_calls``) from :func:`parse_kimi3_output`'s result or from raw generated text, ready to append to the
    conversation for the next turn."""
    parsed = parse_kimi3_output(parsed_or_text) if isinstance(parsed_or_text, str) else parsed_or_text
    message: dict[str, Any] = {"role": "assistant", "content": parsed["content"]}
    if parsed.get("reasoning"):
        message["reasoning_content"] = parsed["reasoning"]
    if parsed.get("tool_calls"):
        message["tool_calls"] = [
            {"type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
            for call in parsed["tool_calls"]
        ]
    return message


# ----------------------------------------------------------------------------------------------------------------
# message normalisation (what the Jinja template cannot do: parse JSON strings, re-sort tool results)
# ----------------------------------------------------------------------------------------------------------------
def _normalize_arguments(arguments):
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments  # rendered as a <json> block, like Moonshot's encoder
        if not isinstance(parsed, dict):
            raise ValueError("Kimi K3 tool call arguments must be a JSON object.")
        return parsed
    return arguments


def normalize_kimi3_messages(messages: list[dict]) -> list[dict]:
    """Tool-call arguments given as JSON strings become dicts, and each run of tool results is put in the order of
    the assistant's calls (matched by ``tool_call_id``) with the matched call's name, as Moonshot's encoder does.
    Returns new message dicts; the input is not modified."""
    out: list[dict] = []
    call_index: dict[str, tuple[int, str | None]] = {}
    i = 0
    while i < len(messages):
        message = messages[i]
        if not isinstance(message, dict):
            out.append(message)
            i += 1
            continue
        if message.get("role") == "assistant":
            message = dict(message)
            calls = []
            call_index = {}
            for position, call in enumerate(message.get("tool_calls") or [], start=1):
                call = dict(call)
                if isinstance(call.get("function"), dict):
                    fn = dict(call["function"])
                    fn["arguments"] = _normalize_arguments(fn.get("arguments"))
                    call["function"] = fn
                else:
                    fn = call
                    call["arguments"] = _normalize_arguments(call.get("arguments"))
                if call.get("id") is not None:
                    call_index.setdefault(str(call["id"]), (position, fn.get("name")))
                calls.append(call)
            if calls:
                message["tool_calls"] = calls
            out.append(message)
            i += 1
            continue
        if message.get("role") != "tool":
            out.append(message)
            i += 1
            continue
        run, unresolved = [], False
        while i < len(messages) and isinstance(messages[i], dict) and messages[i].get("role") == "tool":
            tool_message = messages[i]
            call_id = tool_message.get("tool_call_id", tool_message.get("id"))
            target = call_index.get(str(call_id)) if call_id is not None else None
            if target is None:
                unresolved = True
                run.append((0, tool_message))
            else:
                position, name = target
                resolved = dict(tool_message)
                if name is not None:
                    resolved["tool"] = name
                    if "name" in resolved:
                        resolved["name"] = name
                run.append((position, resolved))
            i += 1
        if unresolved:
            out.extend(m for _, m in run)
        else:
            out.extend(m for _, m in sorted(run, key=lambda item: item[0]))
    return out


# ----------------------------------------------------------------------------------------------------------------
# processor
# ----------------------------------------------------------------------------------------------------------------
try:
    from transformers.utils.chat_template_utils import _CONTROL_TOKEN_START
except ImportError:  # older Transformers: no control-token marking
    _CONTROL_TOKEN_START = "\U000f0000"

# placeholders the user wrote inside sanitized text (apply_chat_template(..., sanitize_control_tokens=True)) are
# marked with a private-use character and are plain text, not images
_PAD_RE = re.compile(f"(?<!{_CONTROL_TOKEN_START})" + re.escape(MEDIA_PAD_TOKEN))
_MEDIA_HEAD = f"{MEDIA_BEGIN_TOKEN}image{MEDIA_CONTENT_TOKEN}"
_TEXT_KWARGS = set(TextKwargs.__annotations__) - {"return_mm_token_type_ids", "return_text_replacement_offsets"}


def _image_size(image) -> tuple[int, int] | None:
    """(width, height) of one image input, or None when it cannot be told cheaply."""
    if Image is not None and isinstance(image, Image.Image):
        return image.size
    if Image is not None and isinstance(image, (bytes, bytearray)):
        import io

        try:
            with Image.open(io.BytesIO(image)) as im:
                return im.size
        except Exception:
            return None
    if isinstance(image, str) and Image is not None:
        try:
            with Image.open(image) as im:
                return im.size
        except Exception:
            return None
    shape = getattr(image, "shape", None)
    if shape is None or len(shape) not in (2, 3):
        return None
    shape = tuple(int(s) for s in shape)
    if len(shape) == 2:
        return shape[1], shape[0]
    is_torch = type(image).__module__.startswith("torch")
    # numpy arrays are HWC unless the first axis is clearly channels; torch tensors CHW unless the last axis is
    if is_torch:
        channels_first = shape[0] in (1, 3, 4) or shape[2] not in (1, 3, 4)
    else:
        channels_first = shape[2] not in (1, 3, 4) and shape[0] in (1, 3, 4)
    return (shape[2], shape[1]) if channels_first else (shape[1], shape[0])


def _flatten(images) -> list:
    if images is None:
        return []
    if isinstance(images, (list, tuple)):
        return [im for item in images for im in _flatten(item)]
    shape = getattr(images, "shape", None)
    if shape is not None and len(shape) == 4:
        return list(images)
    return [images]


class Kimi3Processor(ProcessorMixin):
    r"""Kimi K3 processor: a K3 tokenizer (slow or fast), a :class:`Kimi3ImageProcessor` and the XTML chat template.

    ``processor(text=..., images=...)`` returns ``input_ids``, ``attention_mask`` and, with images,
    ``pixel_values`` [num_patches, 3, 14, 14] and ``grid_thws`` [num_images, 3]. Each image is exactly one
    ``<|media_pad|>`` token in ``input_ids`` (the model expands it to ``h * w / 4`` features). In the text an image
    is written as ``<|media_pad|>``, or as the chat template's block
    ``<|media_begin|>image<|media_content|><|media_pad|><|media_end|>`` (the processor writes the image's pixel size
    into it: ``image 640x480``), or as Moonshot's ``<|kimi_image_placeholder|>``. The number of images must equal
    the number of placeholders, else ``ValueError`` naming both.

    Args:
        image_processor: the image processor (``Kimi3ImageProcessor``).
        tokenizer: ``Kimi3TokenizerFast`` / ``Kimi3Tokenizer`` / a ``PreTrainedTokenizerFast`` loaded from K3 files.
        chat_template: defaults to :data:`special_tokens.CHAT_TEMPLATE`.
        image_size_in_prompt: write ``WxH`` into the media block, as the official processor does.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, image_size_in_prompt=True, **kwargs):
        if chat_template is None:
            chat_template = getattr(tokenizer, "chat_template", None) or CHAT_TEMPLATE
        self.image_size_in_prompt = image_size_in_prompt
        self.image_token = MEDIA_PAD_TOKEN
        super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)
        self.image_token_id = tokenizer.convert_tokens_to_ids(MEDIA_PAD_TOKEN)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {MEDIA_PAD_TOKEN} token")

    @classmethod
    def from_tokenizer(cls, tokenizer, image_processor=None, **kwargs) -> "Kimi3Processor":
        """Builds the processor around ``tokenizer`` with a default ``Kimi3ImageProcessor``."""
        if image_processor is None:
            from .image_processing_kimi3 import Kimi3ImageProcessor

            image_processor = Kimi3ImageProcessor()
        return cls(image_processor=image_processor, tokenizer=tokenizer, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs) -> "Kimi3Processor":
        """``ProcessorMixin.from_pretrained``; when the Auto classes cannot build the image processor (Transformers
        5.17 without torchvision replaces ``AutoImageProcessor`` by a stub, so ``Kimi3ImageProcessor``, which needs
        no torchvision, is not registered there), the processor is built from ``Kimi3ImageProcessor.from_pretrained``
        and ``AutoTokenizer.from_pretrained`` on the same folder instead."""
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except (ValueError, ImportError, OSError) as err:
            try:
                return cls._from_pretrained_without_auto_image_processor(pretrained_model_name_or_path, *args, **kwargs)
            except Exception:
                raise err

    @classmethod
    def _from_pretrained_without_auto_image_processor(
        cls, pretrained_model_name_or_path, cache_dir=None, force_download=False, local_files_only=False, token=None,
        revision="main", **kwargs
    ) -> "Kimi3Processor":
        from transformers import AutoTokenizer

        from .image_processing_kimi3 import Kimi3ImageProcessor

        kwargs.update(cache_dir=cache_dir, force_download=force_download, local_files_only=local_files_only,
                      revision=revision)
        if token is not None:
            kwargs["token"] = token
        processor_dict, instantiation_kwargs = cls.get_processor_dict(pretrained_model_name_or_path, **kwargs)
        image_processor = Kimi3ImageProcessor.from_pretrained(
            pretrained_model_name_or_path, **{k: v for k, v in kwargs.items() if k != "trust_remote_code"}
        )
        tokenizer = AutoTokenizer.from_pretrained(pretrained_model_name_or_path, **kwargs)
        logger.info("Kimi3Processor: image processor built without AutoImageProcessor")
        return cls.from_args_and_dict([image_processor, tokenizer], processor_dict, **instantiation_kwargs)

    # ------------------------------------------------------------------------------------------------------------
    def _expand_text(self, text: list[str], sizes: list[tuple[int, int] | None]) -> list[str]:
        """Write each image's ``WxH`` into the chat template's media block around its placeholder."""
        out, image_idx = [], 0
        for sample in text:
            parts, last = [], 0
            for m in _PAD_RE.finditer(sample):
                segment = sample[last : m.start()]
                size = sizes[image_idx] if image_idx < len(sizes) else None
                if self.image_size_in_prompt and size is not None and segment.endswith(_MEDIA_HEAD):
                    head = f"{MEDIA_BEGIN_TOKEN}image {size[0]}x{size[1]}{MEDIA_CONTENT_TOKEN}"
                    segment = segment[: -len(_MEDIA_HEAD)] + head
                parts += [segment, MEDIA_PAD_TOKEN]
                last = m.end()
                image_idx += 1
            parts.append(sample[last:])
            out.append("".join(parts))
        return out

    def _split_kwargs(self, kwargs: dict) -> tuple[dict, dict, Any]:
        text_kwargs = dict(kwargs.pop("text_kwargs", None) or {})
        images_kwargs = dict(kwargs.pop("images_kwargs", None) or {})
        common_kwargs = dict(kwargs.pop("common_kwargs", None) or {})
        for key in ("videos_kwargs", "audio_kwargs", "return_mm_token_type_ids", "return_text_replacement_offsets"):
            kwargs.pop(key, None)
            text_kwargs.pop(key, None)
        return_tensors = kwargs.pop("return_tensors", None)
        if return_tensors is None:
            return_tensors = text_kwargs.get("return_tensors") or common_kwargs.get("return_tensors")
        text_kwargs.pop("return_tensors", None)
        images_kwargs.pop("return_tensors", None)
        image_keys = set(self.image_processor.to_dict()) if self.image_processor is not None else set()
        for key, value in kwargs.items():
            if key in _TEXT_KWARGS:
                text_kwargs[key] = value
            elif key in image_keys:
                images_kwargs[key] = value
            else:
                logger.warning_once(f"Kimi3Processor: keyword argument {key!r} is not used and was ignored")
        return text_kwargs, images_kwargs, return_tensors

    def __call__(self, images=None, text=None, videos=None, audio=None, **kwargs) -> BatchFeature:
        """Tokenizes ``text`` (str or list of str) and processes ``images`` (one, a list, or a per-sample nested
        list, in the order of the placeholders). Tokenizer keyword arguments (``padding``, ``truncation``,
        ``max_length``, ``padding_side``...) and ``return_tensors`` are accepted."""
        if videos is not None:
            raise NotImplementedError("Kimi3Processor: video input is not supported; pass frames as images")
        if audio is not None:
            raise ValueError("Kimi K3 takes no audio input")
        if text is None and images is None:
            raise ValueError("Kimi3Processor needs `text` and/or `images`")
        text_kwargs, images_kwargs, return_tensors = self._split_kwargs(kwargs)
        flat_images = _flatten(images)
        if flat_images and getattr(self.image_processor, "fetch_images", None) is not None:
            flat_images = [
                self.image_processor.fetch_images(im) if isinstance(im, str) and im.startswith(("http://", "https://"))
                else im
                for im in flat_images
            ]

        data: dict[str, Any] = {}
        if text is None:
            raise ValueError(
                f"Kimi3Processor: {len(flat_images)} image(s) were passed without text; the text must hold one "
                f"{MEDIA_PAD_TOKEN} per image"
            )
        if isinstance(text, str):
            text = [text]
        elif not (isinstance(text, (list, tuple)) and all(isinstance(t, str) for t in text)):
            raise ValueError("`text` must be a string or a list of strings")
        if not text_kwargs.get("sanitize_control_tokens"):
            # Moonshot's plain-text image stand-in; in sanitized chats only user text could hold it, and stays text
            text = [t.replace(KIMI_IMAGE_PLACEHOLDER, IMAGE_PROMPT) for t in text]
        expected = [len(_PAD_RE.findall(t)) for t in text]
        if sum(expected) != len(flat_images):
            raise ValueError(
                f"Kimi3Processor: the text has {sum(expected)} image placeholder(s) ({MEDIA_PAD_TOKEN}) but "
                f"{len(flat_images)} image(s) were passed; each image needs exactly one placeholder."
            )
        if flat_images:
            text = self._expand_text(text, [_image_size(im) for im in flat_images])
        text_inputs = self.tokenizer(text, **text_kwargs)
        counts = [list(row).count(self.image_token_id) for row in text_inputs["input_ids"]]
        if counts != expected:
            raise ValueError(
                f"Kimi3Processor: input_ids hold {counts} image placeholder token(s) per sample but the text has "
                f"{expected}; truncation probably cut an image out (raise max_length or disable truncation)."
            )
        data.update(text_inputs)
        if flat_images:
            image_inputs = self.image_processor(flat_images, return_tensors="np", **images_kwargs)
            data["pixel_values"] = image_inputs["pixel_values"]
            data["grid_thws"] = image_inputs["grid_thws"]
        return BatchFeature(data=data, tensor_type=return_tensors)

    def apply_chat_template(self, conversation, chat_template=None, **kwargs):
        """Transformers' ``apply_chat_template`` after :func:`normalize_kimi3_messages` (JSON-string tool arguments
        become dicts, tool results follow the call order)."""
        if isinstance(conversation, (list, tuple)) and conversation and isinstance(conversation[0], (list, tuple)):
            conversation = [normalize_kimi3_messages(list(c)) for c in conversation]
        elif isinstance(conversation, (list, tuple)):
            conversation = normalize_kimi3_messages(list(conversation))
        return super().apply_chat_template(conversation, chat_template=chat_template, **kwargs)

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        """Saves like any processor, and also writes ``tiktoken.model`` (recovered from the fast tokenizer when the
        tokenizer did not come with one) so that the slow ``Kimi3Tokenizer`` loads from the folder too."""
        files = super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        vocab_path = os.path.join(save_directory, "tiktoken.model")
        if not os.path.isfile(vocab_path) and getattr(self.tokenizer, "backend_tokenizer", None) is not None:
            try:
                save_tiktoken_ranks(tiktoken_ranks_from_fast(self.tokenizer), vocab_path)
            except ValueError:
                pass  # not a converted tiktoken vocabulary: nothing to write
        return files

    def parse_output(self, generated, prompt=None) -> dict[str, Any]:
        """:func:`parse_kimi3_output` on generated text or token ids (decoded keeping the XTML markers); ``prompt``
        (text or ids) tells which channel the generation started in."""
        def as_text(x):
            if x is None or isinstance(x, str):
                return x
            x = x.tolist() if hasattr(x, "tolist") else x
            if x and isinstance(x[0], list):
                if len(x) != 1:
                    raise ValueError("parse_output takes one sequence, not a batch")
                x = x[0]
            return self.tokenizer.decode(x, skip_special_tokens=False)

        return parse_kimi3_output(as_text(generated), prefix=as_text(prompt))

    def post_process_image_text_to_text(self, generated_outputs, skip_special_tokens=True, **kwargs):
        return self.tokenizer.batch_decode(generated_outputs, skip_special_tokens=skip_special_tokens, **kwargs)

    @property
    def model_input_names(self):
        return ["input_ids", "attention_mask", "pixel_values", "grid_thws"]


__all__ = [
    "Kimi3Processor",
    "kimi3_output_to_message",
    "normalize_kimi3_messages",
    "parse_kimi3_output",
]
