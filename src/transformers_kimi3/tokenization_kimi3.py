"""Kimi K3 tokenizer.

K3 ships a tiktoken BPE: ``tiktoken.model`` (one ``<base64 token> <rank>`` per line, ranks 0..N-1) plus a block of
``num_reserved_special_tokens`` (256 for the released model) special ids right after the last rank. The names of
the special ids are listed in ``tokenizer_config.json`` (``added_tokens_decoder``); every other id of the block is
``<|reserved_token_{id}|>``. The released layout, the split pattern and the file format are in
:mod:`special_tokens`. ``<|end_of_msg|>`` ends every chat message and is the generation stop token
(``eos_token_id`` of the model config); this tokenizer therefore uses it as ``eos_token``.

Two classes:

* :class:`Kimi3Tokenizer`: the slow tokenizer, a ``PreTrainedTokenizer`` that runs ``tiktoken`` (optional
  dependency) exactly like Moonshot's ``tokenization_kimi.py`` does.
* :class:`Kimi3TokenizerFast`: a ``PreTrainedTokenizerFast`` (``tokenizers`` backend) converted from the same
  ranks: ByteLevel BPE with the same split regex and the special ids as added tokens. It needs neither tiktoken nor
  remote code: a saved ``tokenizer.json`` loads with plain ``AutoTokenizer``.

:func:`convert_tiktoken_to_fast` writes ``tokenizer.json`` next to an official ``tiktoken.model``.
"""

from __future__ import annotations

import json
import os
from shutil import copyfile

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE
from transformers import PreTrainedTokenizer, PreTrainedTokenizerFast

from .special_tokens import (
    BOS_TOKEN,
    BYTE_DECODER,
    CHAT_TEMPLATE,
    END_OF_MSG_TOKEN,
    K3_SPECIAL_TOKEN_OFFSETS,
    NUM_RESERVED_SPECIAL_TOKENS,
    PAD_TOKEN,
    PAT_STR,
    RESERVED_TOKEN_PREFIX,
    UNK_TOKEN,
    load_tiktoken_ranks,
    reserved_token_name,
    save_tiktoken_ranks,
    tiktoken_ranks_from_fast,
    token_bytes_to_string,
)


VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}
FAST_VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model", "tokenizer_file": "tokenizer.json"}

# tiktoken panics on >400k characters and is quadratic on long runs; Moonshot's tokenizer cuts the text the same way
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000


def _as_added_token(value, special_default: bool = True) -> AddedToken:
    if isinstance(value, AddedToken):
        return value
    if isinstance(value, dict):
        keys = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
        kw = {k: v for k, v in value.items() if k in keys}
        kw.setdefault("special", special_default)
        kw.setdefault("normalized", False)
        return AddedToken(**kw)
    return AddedToken(str(value), special=special_default, normalized=False)


def special_token_slots(
    num_base_tokens: int,
    added_tokens_decoder: dict | None = None,
    num_reserved_special_tokens: int = NUM_RESERVED_SPECIAL_TOKENS,
) -> dict[int, AddedToken]:
    """The full block of special ids ``[num_base_tokens, num_base_tokens + num_reserved_special_tokens)``.

    Names come from ``added_tokens_decoder`` (as in ``tokenizer_config.json``); without one, the released K3 layout
    is used. Unnamed ids become ``<|reserved_token_{id}|>`` (special), as in Moonshot's tokenizer.
    """
    named: dict[int, AddedToken] = {}
    if added_tokens_decoder:
        for index, value in added_tokens_decoder.items():
            named[int(index)] = _as_added_token(value)
    else:
        for offset, (name, special) in K3_SPECIAL_TOKEN_OFFSETS.items():
            if offset < num_reserved_special_tokens:
                named[num_base_tokens + offset] = AddedToken(name, special=special, normalized=False)
    end = num_base_tokens + num_reserved_special_tokens
    for index in named:
        if not num_base_tokens <= index < end:
            raise ValueError(
                f"special token {named[index].content!r} has id {index}, outside the special block "
                f"[{num_base_tokens}, {end}) that follows the {num_base_tokens} BPE ranks"
            )
    slots = {}
    for index in range(num_base_tokens, end):
        token = named.get(index)
        if token is None:
            token = AddedToken(reserved_token_name(index), special=True, normalized=False)
        # added tokens match exactly as written, like tiktoken's special tokens
        slots[index] = AddedToken(
            token.content, special=token.special, normalized=False, lstrip=False, rstrip=False, single_word=False
        )
    contents = [t.content for t in slots.values()]
    if len(set(contents)) != len(contents):
        raise ValueError("special token names must be unique")
    return slots


def build_fast_backend(ranks: dict[bytes, int], slots: dict[int, AddedToken]) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` equal to tiktoken on ``ranks`` with the K3 split regex and ``slots`` as added tokens.

    tiktoken merges, at each step, the adjacent pair whose concatenation has the lowest rank. A BPE whose merge list
    holds every split ``(l, r)`` of every token (with ``l``, ``r`` in the vocabulary), ordered by the rank of ``l + r``,
    makes the same choices; ``ignore_merges`` reproduces tiktoken's shortcut for pieces that are whole tokens.
    """
    vocab = {token_bytes_to_string(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        local = []
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                local.append((ranks[left], ranks[right], left, right))
        local.sort()
        merges.extend((rank, lr, rr, left, right) for lr, rr, left, right in local)
    merges.sort(key=lambda m: (m[0], m[1], m[2]))
    merges = [(token_bytes_to_string(m[3]), token_bytes_to_string(m[4])) for m in merges]

    tokenizer = Tokenizer(BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    n = len(ranks)
    for index in sorted(slots):
        if index != n:
            raise ValueError(f"special ids must follow the ranks without gaps: expected id {n}, got {index}")
        token = slots[index]
        if token.special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
        got = tokenizer.token_to_id(token.content)
        if got != index:
            raise ValueError(f"added token {token.content!r} got id {got}, expected {index}")
        n += 1
    return tokenizer


def _require_tiktoken():
    try:
        import tiktoken
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "Kimi3Tokenizer (the slow, tiktoken-based tokenizer) needs `pip install tiktoken`. The fast tokenizer "
            "(`Kimi3TokenizerFast`, or `AutoTokenizer` on a folder with `tokenizer.json`) does not."
        ) from err
    return tiktoken


def _split_whitespaces_or_nonwhitespaces(s: str, max_len: int):
    """Cut ``s`` so that no piece holds more than ``max_len`` consecutive whitespace or non-whitespace characters."""
    current_len = 0
    current_is_space = s[0].isspace() if s else False
    start = 0
    for i, ch in enumerate(s):
        is_space = ch.isspace()
        if current_is_space ^ is_space:
            current_len = 1
            current_is_space = is_space
        else:
            current_len += 1
            if current_len > max_len:
                yield s[start:i]
                start = i
                current_len = 1
    yield s[start:]


def _config_kwargs_defaults(kwargs: dict) -> dict:
    for key in ("backend", "tokenizer_file", "tokenizer_object"):
        kwargs.pop(key, None)
    kwargs.setdefault("clean_up_tokenization_spaces", False)
    kwargs.setdefault("model_max_length", 1048576)
    return kwargs


class Kimi3Tokenizer(PreTrainedTokenizer):
    """Slow K3 tokenizer: tiktoken over ``tiktoken.model``, special ids from ``tokenizer_config.json``.

    Encoding equals Moonshot's ``TikTokenTokenizer`` (same ranks, split regex, special tokens recognised in text,
    no BOS added). ``decode`` works on bytes, so multi-byte characters split across tokens decode correctly.

    Args:
        vocab_file: path of ``tiktoken.model``.
        num_reserved_special_tokens: size of the special-id block after the ranks (256 for K3).
        added_tokens_decoder: id -> token for the named special ids (``tokenizer_config.json`` format); defaults to
            the released K3 names.
    """

    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]
    pat_str = PAT_STR

    def __init__(
        self,
        vocab_file,
        bos_token=BOS_TOKEN,
        eos_token=END_OF_MSG_TOKEN,
        unk_token=UNK_TOKEN,
        pad_token=PAD_TOKEN,
        added_tokens_decoder=None,
        num_reserved_special_tokens: int = NUM_RESERVED_SPECIAL_TOKENS,
        **kwargs,
    ):
        tiktoken = _require_tiktoken()
        kwargs = _config_kwargs_defaults(kwargs)
        if not os.path.isfile(vocab_file):
            raise FileNotFoundError(f"tiktoken vocabulary not found: {vocab_file}")
        self.vocab_file = vocab_file
        self.num_reserved_special_tokens = int(num_reserved_special_tokens)
        ranks = load_tiktoken_ranks(vocab_file)
        self.num_base_tokens = len(ranks)
        slots = special_token_slots(self.num_base_tokens, added_tokens_decoder, self.num_reserved_special_tokens)
        self._tiktoken = tiktoken.Encoding(
            name=os.path.basename(vocab_file),
            pat_str=self.pat_str,
            mergeable_ranks=ranks,
            special_tokens={tok.content: index for index, tok in slots.items()},
        )
        self._id_to_bytes = [b""] * self.num_base_tokens
        for token, rank in ranks.items():
            self._id_to_bytes[rank] = token
        self._id_to_str = [token_bytes_to_string(b) for b in self._id_to_bytes]
        self._str_to_id = {s: i for i, s in enumerate(self._id_to_str)}
        self._added_tokens_decoder = dict(slots)
        super().__init__(
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
            pad_token=pad_token,
            num_reserved_special_tokens=self.num_reserved_special_tokens,
            **kwargs,
        )

    # --- vocabulary -------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of BPE ranks (without the special block), like ``vocab_size`` of the fast tokenizer."""
        return self.num_base_tokens

    def get_vocab(self) -> dict[str, int]:
        vocab = dict(self._str_to_id)
        vocab.update({tok.content: index for index, tok in self._added_tokens_decoder.items()})
        return vocab

    # --- encoding ---------------------------------------------------------------------------------------------
    def _encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
            for piece in _split_whitespaces_or_nonwhitespaces(
                text[i : i + TIKTOKEN_MAX_ENCODE_CHARS], MAX_NO_WHITESPACES_CHARS
            ):
                ids.extend(self._tiktoken.encode_ordinary(piece))
        return ids

    def encode_tiktoken(self, text: str, allow_special_tokens: bool = True) -> list[int]:
        """Encode exactly like Moonshot's ``TikTokenTokenizer.encode`` (special-token names in ``text`` become
        their ids when ``allow_special_tokens``, else they are encoded as text)."""
        if not allow_special_tokens:
            return self._encode_ordinary(text)
        ids: list[int] = []
        for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
            for piece in _split_whitespaces_or_nonwhitespaces(
                text[i : i + TIKTOKEN_MAX_ENCODE_CHARS], MAX_NO_WHITESPACES_CHARS
            ):
                ids.extend(self._tiktoken.encode(piece, allowed_special="all"))
        return ids

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        # Called on the text between added tokens (the trie of PreTrainedTokenizer already split them off), or on
        # the whole text with split_special_tokens=True: tiktoken without special tokens in both cases.
        return [self._id_to_str[i] for i in self._encode_ordinary(text)]

    def _encode_without_added_tokens(self, text: str) -> list[int]:
        """``text`` as plain text, no added token (special or not) matched: tiktoken without special tokens. Newer
        Transformers encode the control tokens that ``apply_chat_template(..., sanitize_control_tokens=True)``
        found in user text with it; defined here so that every supported release has it."""
        return self._encode_ordinary(text)

    def _convert_token_to_id(self, token: str) -> int:
        index = self._str_to_id.get(token)
        if index is None:
            index = self._added_tokens_encoder.get(token, self.unk_token_id)
        return index

    def _convert_id_to_token(self, index: int) -> str:
        if 0 <= index < self.num_base_tokens:
            return self._id_to_str[index]
        token = self._added_tokens_decoder.get(index)
        if token is None:
            raise IndexError(f"token id {index} is outside the vocabulary of {len(self)} ids")
        return token.content

    # --- decoding ---------------------------------------------------------------------------------------------
    def _special_ids_to_skip(self) -> set[int]:
        skip = {index for index, tok in self._added_tokens_decoder.items() if tok.special}
        skip.update(self.all_special_ids)
        return skip

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        out = bytearray()
        for token in tokens:
            if token in self._added_tokens_encoder:
                out += token.encode("utf-8")
            else:
                out += bytes(BYTE_DECODER[ch] for ch in token)
        return out.decode("utf-8", errors="replace")

    def _decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces=None, **kwargs) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        skip = self._special_ids_to_skip() if skip_special_tokens else ()
        out = bytearray()
        for index in token_ids:
            index = int(index)
            if index in skip:
                continue
            if 0 <= index < self.num_base_tokens:
                out += self._id_to_bytes[index]
            else:
                out += self._convert_id_to_token(index).encode("utf-8")
        text = out.decode("utf-8", errors="replace")
        if clean_up_tokenization_spaces:
            text = self.clean_up_tokenization(text)
        return text

    # --- saving -----------------------------------------------------------------------------------------------
    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        """Copy ``tiktoken.model`` and write the converted ``tokenizer.json``, so that the saved folder also loads
        with plain ``AutoTokenizer`` (no tiktoken, no remote code)."""
        if not os.path.isdir(save_directory):
            raise ValueError(f"vocabulary path ({save_directory}) should be a directory")
        prefix = filename_prefix + "-" if filename_prefix else ""
        out_vocab_file = os.path.join(save_directory, prefix + VOCAB_FILES_NAMES["vocab_file"])
        if os.path.abspath(self.vocab_file) != os.path.abspath(out_vocab_file):
            copyfile(self.vocab_file, out_vocab_file)
        out_fast_file = os.path.join(save_directory, prefix + FAST_VOCAB_FILES_NAMES["tokenizer_file"])
        self.to_fast_backend().save(out_fast_file)
        return (out_vocab_file, out_fast_file)

    def to_fast_backend(self) -> Tokenizer:
        """The converted ``tokenizers.Tokenizer`` (ByteLevel BPE, same regex, same added tokens)."""
        ranks = {token: index for index, token in enumerate(self._id_to_bytes)}
        slots = {index: tok for index, tok in self._added_tokens_decoder.items() if index >= self.num_base_tokens}
        return build_fast_backend(ranks, slots)

    def to_fast(self) -> "Kimi3TokenizerFast":
        """A :class:`Kimi3TokenizerFast` with the same vocabulary, special tokens and chat template."""
        return Kimi3TokenizerFast(
            vocab_file=self.vocab_file,
            tokenizer_object=self.to_fast_backend(),
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            unk_token=self.unk_token,
            pad_token=self.pad_token,
            num_reserved_special_tokens=self.num_reserved_special_tokens,
            chat_template=self.chat_template,
            padding_side=self.padding_side,
            model_max_length=self.model_max_length,
        )


class Kimi3TokenizerFast(PreTrainedTokenizerFast):
    """Fast K3 tokenizer (``tokenizers`` backend), converted from ``tiktoken.model`` when no ``tokenizer.json`` exists.

    The saved folder holds a plain ``tokenizer.json``; ``AutoTokenizer.from_pretrained(folder)`` loads it without
    remote code (as ``PreTrainedTokenizerFast``/``TokenizersBackend``) and gives the same ids.
    """

    vocab_files_names = FAST_VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]
    slow_tokenizer_class = Kimi3Tokenizer

    def __init__(
        self,
        vocab_file=None,
        tokenizer_file=None,
        bos_token=BOS_TOKEN,
        eos_token=END_OF_MSG_TOKEN,
        unk_token=UNK_TOKEN,
        pad_token=PAD_TOKEN,
        added_tokens_decoder=None,
        num_reserved_special_tokens: int = NUM_RESERVED_SPECIAL_TOKENS,
        **kwargs,
    ):
        tokenizer_object = kwargs.pop("tokenizer_object", None)
        kwargs.pop("backend", None)
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        kwargs.setdefault("model_max_length", 1048576)
        if tokenizer_object is None and not (tokenizer_file and os.path.isfile(tokenizer_file)):
            if not (vocab_file and os.path.isfile(vocab_file)):
                raise ValueError(
                    "Kimi3TokenizerFast needs `tokenizer_file` (tokenizer.json) or `vocab_file` (tiktoken.model)"
                )
            ranks = load_tiktoken_ranks(vocab_file)
            slots = special_token_slots(len(ranks), added_tokens_decoder, num_reserved_special_tokens)
            tokenizer_object = build_fast_backend(ranks, slots)
        if tokenizer_object is not None:
            kwargs["tokenizer_object"] = tokenizer_object
        else:
            kwargs["tokenizer_file"] = tokenizer_file
        self.num_reserved_special_tokens = int(num_reserved_special_tokens)
        super().__init__(
            vocab_file=vocab_file,
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
            pad_token=pad_token,
            num_reserved_special_tokens=self.num_reserved_special_tokens,
            **kwargs,
        )
        self.vocab_file = vocab_file

    @classmethod
    def convert_to_native_format(cls, trust_remote_code=False, **kwargs):
        # __init__ builds the backend itself (from tokenizer.json, else from tiktoken.model)
        return kwargs

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        if not self.vocab_file or not os.path.isfile(self.vocab_file):
            return ()
        out = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "tiktoken.model")
        if os.path.abspath(self.vocab_file) != os.path.abspath(out):
            copyfile(self.vocab_file, out)
        return (out,)


def write_kimi3_tokenizer(
    out_dir: str | os.PathLike,
    ranks: dict[bytes, int],
    slots: dict[int, AddedToken],
    named: set[str] | None = None,
    chat_template: str | None = None,
    padding_side: str = "left",
) -> "Kimi3TokenizerFast":
    """Write a complete K3 tokenizer folder: ``tiktoken.model``, ``tokenizer.json``, ``tokenizer_config.json``
    (``tokenizer_class`` ``TokenizersBackend``, so plain ``AutoTokenizer`` loads it; ``added_tokens_decoder`` lists
    the ``named`` special tokens like the released file, the reserved ids are implied), ``special_tokens_map.json``
    and ``chat_template.jinja`` (default: :data:`special_tokens.CHAT_TEMPLATE`). Returns the tokenizer."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    if chat_template is None:
        chat_template = CHAT_TEMPLATE
    vocab_file = os.path.join(out_dir, "tiktoken.model")
    save_tiktoken_ranks(ranks, vocab_file)
    num_reserved = len(slots)
    tokenizer = Kimi3TokenizerFast(
        vocab_file=vocab_file,
        tokenizer_object=build_fast_backend(ranks, slots),
        num_reserved_special_tokens=num_reserved,
        chat_template=chat_template,
        padding_side=padding_side,
    )
    tokenizer.save_pretrained(out_dir)
    if named is None:
        named = {tok.content for tok in slots.values() if not tok.content.startswith(RESERVED_TOKEN_PREFIX)}
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["added_tokens_decoder"] = {
        str(index): {"content": tok.content, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": tok.special}
        for index, tok in sorted(slots.items())
        if tok.content in named
    }
    config["tokenizer_class"] = "TokenizersBackend"
    config["num_reserved_special_tokens"] = num_reserved
    config.pop("auto_map", None)
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        keys = ("bos_token", "eos_token", "unk_token", "pad_token")
        special_map = {key: str(getattr(tokenizer, key)) for key in keys}
        json.dump(special_map, f, indent=2)
        f.write("\n")
    template_path = os.path.join(out_dir, "chat_template.jinja")
    if not os.path.isfile(template_path):
        with open(template_path, "w", encoding="utf-8") as f:
            f.write(chat_template)
    return tokenizer


def _read_official_config(model_dir: str) -> tuple[dict | None, int]:
    added, num_reserved = None, NUM_RESERVED_SPECIAL_TOKENS
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
        added = config.get("added_tokens_decoder") or None
        num_reserved = int(config.get("num_reserved_special_tokens", num_reserved))
    return added, num_reserved


def convert_tiktoken_to_fast(model_dir: str | os.PathLike, output_dir: str | os.PathLike | None = None) -> str:
    """Write only ``tokenizer.json`` for a folder holding ``tiktoken.model`` + ``tokenizer_config.json`` (e.g. the
    official ``moonshotai/Kimi-K3`` files). Returns the path written. Needs neither tiktoken nor Moonshot's code."""
    model_dir = os.fspath(model_dir)
    output_dir = os.fspath(output_dir or model_dir)
    os.makedirs(output_dir, exist_ok=True)
    added, num_reserved = _read_official_config(model_dir)
    ranks = load_tiktoken_ranks(os.path.join(model_dir, "tiktoken.model"))
    backend = build_fast_backend(ranks, special_token_slots(len(ranks), added, num_reserved))
    out = os.path.join(output_dir, "tokenizer.json")
    backend.save(out)
    return out


def convert_kimi3_tokenizer(
    model_dir: str | os.PathLike, output_dir: str | os.PathLike, chat_template: str | None = None
) -> "Kimi3TokenizerFast":
    """Turn an official K3 tokenizer folder (``tiktoken.model`` + ``tokenizer_config.json`` with Moonshot's remote
    tokenizer class) into this project's files (see :func:`write_kimi3_tokenizer`): converted ``tokenizer.json``,
    ``eos_token`` = ``<|end_of_msg|>`` (the stop token), ``pad_token`` = ``[PAD]``, the K3 chat template, left
    padding. Special-token names and flags come from the official ``added_tokens_decoder``."""
    model_dir = os.fspath(model_dir)
    added, num_reserved = _read_official_config(model_dir)
    ranks = load_tiktoken_ranks(os.path.join(model_dir, "tiktoken.model"))
    slots = special_token_slots(len(ranks), added, num_reserved)
    named = {str(_as_added_token(v).content) for v in added.values()} if added else None
    return write_kimi3_tokenizer(output_dir, ranks, slots, named=named, chat_template=chat_template)


__all__ = [
    "Kimi3Tokenizer",
    "Kimi3TokenizerFast",
    "build_fast_backend",
    "convert_kimi3_tokenizer",
    "convert_tiktoken_to_fast",
    "load_tiktoken_ranks",
    "save_tiktoken_ranks",
    "special_token_slots",
    "tiktoken_ranks_from_fast",
    "write_kimi3_tokenizer",
]
