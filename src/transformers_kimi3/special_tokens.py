"""The K3 token format, shared by the tokenizer and the processor.

Everything both sides must agree on is defined here once: the names and ids of the special tokens, the split
pattern of the BPE, the ``tiktoken.model`` file and its byte alphabet, and the XTML chat template. The module
imports nothing from the package: it is copied flat next to ``processing_kimi3.py`` into saved model folders
(``trust_remote_code``), and both ``tokenization_kimi3`` and ``processing_kimi3`` import it without importing each
other. The chat template is a Python string (not a ``.jinja`` file) so that the copied module carries it.

Released K3 ids (``tiktoken.model`` holds N = 163,584 ranks; 256 special ids follow, 163,840 ids in all)::

    163584 [BOS]          163587 <|open|>    163590 [start_header_id]   163602 <|media_begin|>
    163585 [EOS]          163588 <|close|>   163591 [end_header_id]     163603 <|media_content|>
    163586 <|end_of_msg|> 163589 <|sep|>     163593 [EOT]               163604 <|media_end|>
    163605 <|media_pad|>  163649 <osagent_mode>  163838 [UNK]           163839 [PAD]

Every other id of the special block is ``<|reserved_token_{id}|>`` (:func:`reserved_token_name`). ``<|open|>``,
``<|close|>`` and ``<|sep|>`` (the XTML markers) are not special, so ``decode(..., skip_special_tokens=True)`` keeps
them and generated text can still be parsed. ``<|end_of_msg|>`` ends every chat message and is the generation stop
token.
"""

from __future__ import annotations

import base64
import os

# --- special tokens -----------------------------------------------------------------------------------------------
NUM_RESERVED_SPECIAL_TOKENS = 256

BOS_TOKEN = "[BOS]"
EOS_TOKEN = "[EOS]"
END_OF_MSG_TOKEN = "<|end_of_msg|>"
OPEN_TOKEN = "<|open|>"
CLOSE_TOKEN = "<|close|>"
SEP_TOKEN = "<|sep|>"
START_HEADER_TOKEN = "[start_header_id]"
END_HEADER_TOKEN = "[end_header_id]"
EOT_TOKEN = "[EOT]"
MEDIA_BEGIN_TOKEN = "<|media_begin|>"
MEDIA_CONTENT_TOKEN = "<|media_content|>"
MEDIA_END_TOKEN = "<|media_end|>"
MEDIA_PAD_TOKEN = "<|media_pad|>"
OSAGENT_MODE_TOKEN = "<osagent_mode>"
UNK_TOKEN = "[UNK]"
PAD_TOKEN = "[PAD]"

# offset from the first special id -> (name, special), as in the released tokenizer_config.json
K3_SPECIAL_TOKEN_OFFSETS = {
    0: (BOS_TOKEN, True),
    1: (EOS_TOKEN, True),
    2: (END_OF_MSG_TOKEN, True),
    3: (OPEN_TOKEN, False),
    4: (CLOSE_TOKEN, False),
    5: (SEP_TOKEN, False),
    6: (START_HEADER_TOKEN, True),
    7: (END_HEADER_TOKEN, True),
    9: (EOT_TOKEN, True),
    18: (MEDIA_BEGIN_TOKEN, True),
    19: (MEDIA_CONTENT_TOKEN, True),
    20: (MEDIA_END_TOKEN, True),
    21: (MEDIA_PAD_TOKEN, True),
    65: (OSAGENT_MODE_TOKEN, True),
    254: (UNK_TOKEN, True),
    255: (PAD_TOKEN, True),
}

# every unnamed id of the special block
RESERVED_TOKEN_PREFIX = "<|reserved_token_"


def reserved_token_name(index: int) -> str:
    """The name of the unnamed special id ``index``, as in Moonshot's tokenizer."""
    return f"{RESERVED_TOKEN_PREFIX}{index}|>"


# An image in the text: one <|media_pad|> in a media block (the processor writes the pixel size after "image").
IMAGE_PROMPT = f"{MEDIA_BEGIN_TOKEN}image{MEDIA_CONTENT_TOKEN}{MEDIA_PAD_TOKEN}{MEDIA_END_TOKEN}"
# The plain-text stand-in Moonshot's encoder writes for an image; not a token, the processor replaces it.
KIMI_IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"

# --- BPE split pattern --------------------------------------------------------------------------------------------
# Pre-tokenizer of Kimi K2 / Kimi-VL / Kimi K3 (`tokenization_kimi.py`): Han runs, letter words (case-aware,
# Han excluded), 1-3 digit groups, punctuation runs, newlines, whitespace. `&&` is class intersection, which both
# tiktoken (fancy-regex) and tokenizers (Oniguruma) understand.
PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


# --- tiktoken.model and the ByteLevel alphabet --------------------------------------------------------------------
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table (the ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


BYTE_ENCODER = bytes_to_unicode()
BYTE_DECODER = {v: k for k, v in BYTE_ENCODER.items()}


def token_bytes_to_string(token: bytes) -> str:
    """A token's bytes as the ByteLevel string the fast tokenizer stores."""
    return "".join(BYTE_ENCODER[b] for b in token)


def load_tiktoken_ranks(vocab_file: str | os.PathLike) -> dict[bytes, int]:
    """Read a tiktoken BPE file (``<base64> <rank>`` per line). Checks that ranks are exactly 0..N-1."""
    ranks: dict[bytes, int] = {}
    with open(vocab_file, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            line = line.strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{vocab_file}:{line_no}: expected '<base64 token> <rank>', got {line[:80]!r}")
            token, rank = base64.b64decode(parts[0]), int(parts[1])
            if token in ranks:
                raise ValueError(f"{vocab_file}:{line_no}: token {token!r} appears twice")
            ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{vocab_file}: ranks must be exactly 0..{len(ranks) - 1} with no gaps or repeats")
    return ranks


def save_tiktoken_ranks(ranks: dict[bytes, int], vocab_file: str | os.PathLike) -> None:
    with open(vocab_file, "w", encoding="ascii") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(token).decode('ascii')} {rank}\n")


def tiktoken_ranks_from_fast(tokenizer) -> dict[bytes, int]:
    """Recover the tiktoken ranks (``tiktoken.model``) from a converted fast tokenizer: the BPE vocabulary without
    the added tokens, each ByteLevel string mapped back to its bytes. Inverse of the conversion in
    ``tokenization_kimi3.build_fast_backend``."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    added = set(backend.get_added_tokens_decoder())
    ranks = {}
    for token, index in backend.get_vocab(with_added_tokens=False).items():
        if index in added:
            continue
        try:
            ranks[bytes(BYTE_DECODER[ch] for ch in token)] = index
        except KeyError as err:
            raise ValueError(f"token {token!r} is not ByteLevel: not a converted tiktoken vocabulary") from err
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("the vocabulary ids are not contiguous from 0: not a converted tiktoken vocabulary")
    return ranks


# --- chat template ------------------------------------------------------------------------------------------------
# The XTML format is described in processing_kimi3.py. CHAT_TEMPLATE (below) is this body preceded by the markers it
# writes, taken from the constants above. Its CONTROL_TOKENS list (what `sanitize_control_tokens` breaks in user text)
# covers every special name: '<|' catches the <|...|> names, the others are listed.
_CHAT_TEMPLATE_BODY = r"""{%- if thinking is defined and thinking is not none -%}
    {%- set think_on = thinking -%}
{%- elif enable_thinking is defined and enable_thinking is not none -%}
    {%- set think_on = enable_thinking -%}
{%- else -%}
    {%- set think_on = true -%}
{%- endif -%}
{%- set effort = thinking_effort if thinking_effort is defined else 'max' -%}
{#- `sanitize_control_tokens` reaches the template only from Transformers releases that do not implement it (newer
    ones mark the control tokens of the inputs themselves and never pass it on): then the control tokens in the
    inputs are broken with a zero-width space, so that they are encoded as text. -#}
{%- set SANITIZE = sanitize_control_tokens is defined and sanitize_control_tokens -%}
{%- set CONTROL_TOKENS = ['<|', '[BOS]', '[EOS]', '[start_header_id]', '[end_header_id]', '[EOT]', '[UNK]', '[PAD]',
                         '<osagent_mode>'] -%}
{%- macro user_text(value) -%}
    {%- if SANITIZE -%}
        {%- set out = namespace(text=value | string) -%}
        {%- for token in CONTROL_TOKENS -%}
            {%- set out.text = out.text | replace(token, token[0] ~ '\u200b' ~ token[1:]) -%}
        {%- endfor -%}
        {{ out.text }}
    {%- else -%}
        {{ value }}
    {%- endif -%}
{%- endmacro -%}
{%- macro attr(value) -%}{{ user_text(value) | replace('&', '&amp;') | replace('"', '&quot;') }}{%- endmacro -%}
{%- macro note(kind, body) -%}
{{ OPEN }}message role="system" type="{{ kind }}"{{ SEP }}{{ body | trim }}{{ CLOSE }}message{{ SEP }}{{ EOM }}
{%- endmacro -%}
{%- macro content_of(content) -%}
    {%- if content is string -%}
        {{ user_text(content) }}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{ user_text(part) }}
            {%- elif part['type'] in ('image', 'image_url') -%}
                {{ IMAGE }}
            {%- elif part['text'] is defined -%}
                {{ user_text(part['text']) }}
            {%- else -%}
                {{ raise_exception('Kimi K3 chat template: unsupported content type "' ~ part['type'] ~ '"') }}
            {%- endif -%}
        {%- endfor -%}
    {%- elif content is not none and content is defined -%}
        {{ user_text(content) }}
    {%- endif -%}
{%- endmacro -%}
{%- macro xtml_type(value) -%}
    {%- if value is boolean -%}boolean{%- elif value is none -%}null{%- elif value is number -%}number
    {%- elif value is string -%}string{%- elif value is mapping -%}object{%- else -%}array{%- endif -%}
{%- endmacro -%}
{%- macro tool_declare(tool_list, dynamic) -%}
    {%- if dynamic -%}
        {%- set head = '## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\nYou have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n' -%}
    {%- else -%}
        {%- set head = '# Tools\nHere are the available tools, described in JSONSchema.\n\n' -%}
    {%- endif -%}
    {{- note('tool-declare', head ~ '```json\n' ~ user_text(tool_list | tojson(separators=(',', ':'), sort_keys=true)) ~ '\n```') -}}
{%- endmacro -%}
{#- ---- request checks: the template renders only what it understands, so a malformed tool schema or an unknown
    tool_choice / response_format is refused (raise_exception) rather than written verbatim or dropped ---- -#}
{%- macro shown(value) -%}
    {%- if value is string -%}{{ value | tojson }}{%- elif value is boolean -%}bool{%- elif value is none -%}None
    {%- elif value is integer -%}int{%- elif value is float -%}float{%- elif value is mapping -%}dict
    {%- elif value is iterable -%}list{%- else -%}{{ value }}{%- endif -%}
{%- endmacro -%}
{%- macro check_tools(tool_list, where) -%}
    {%- set TOOL_FORM = '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}' -%}
    {%- if tool_list is string or tool_list is mapping or tool_list is not iterable -%}
        {{- raise_exception(where ~ ' must be a list of tools such as ' ~ TOOL_FORM ~ ', got ' ~ shown(tool_list)) -}}
    {%- endif -%}
    {%- for tool in tool_list -%}
        {%- set at = where ~ '[' ~ loop.index0 ~ ']' -%}
        {%- if tool is not mapping -%}
            {{- raise_exception(at ~ ' must be a JSON object (dict) such as ' ~ TOOL_FORM ~ ', got ' ~ shown(tool)) -}}
        {%- elif tool['function'] is not defined -%}
            {{- raise_exception(at ~ ': no "function"; a tool is ' ~ TOOL_FORM) -}}
        {%- elif tool['function'] is not mapping -%}
            {{- raise_exception(at ~ '.function must be a JSON object (dict), got ' ~ shown(tool['function'])) -}}
        {%- endif -%}
        {%- set fn = tool['function'] -%}
        {%- if fn['name'] is not defined or fn['name'] is not string or not fn['name'] | trim -%}
            {{- raise_exception(at ~ '.function: "name" must be a non-empty string, got ' ~ (shown(fn['name']) if fn['name'] is defined else 'nothing')) -}}
        {%- elif fn['description'] is defined and fn['description'] is not none and fn['description'] is not string -%}
            {{- raise_exception(at ~ '.function.description must be a string, got ' ~ shown(fn['description'])) -}}
        {%- elif fn['parameters'] is defined and fn['parameters'] is not none and fn['parameters'] is not mapping -%}
            {{- raise_exception(at ~ '.function.parameters must be a JSON object (dict), got ' ~ shown(fn['parameters'])) -}}
        {%- endif -%}
    {%- endfor -%}
{%- endmacro -%}
{%- if tools is defined and tools is not none -%}
    {{- check_tools(tools, 'tools') -}}
{%- endif -%}
{%- if tool_choice is defined and tool_choice is not none -%}
    {%- if tool_choice is mapping -%}
        {{- raise_exception('Unsupported tool_choice=' ~ tool_choice ~ ": the template cannot force a named tool; supported values are ['auto', 'none', 'required'] (to force one tool, declare only that tool and pass tool_choice='required').") -}}
    {%- elif tool_choice is not string or tool_choice not in ('auto', 'none', 'required') -%}
        {{- raise_exception('Unsupported tool_choice=' ~ (tool_choice | tojson if tool_choice is string else tool_choice) ~ "; supported values are ['auto', 'none', 'required'].") -}}
    {%- endif -%}
{%- endif -%}
{%- if response_format is defined and response_format is not none -%}
    {%- set RF_TYPES = "['json_object', 'json_schema', 'text']" -%}
    {%- if response_format is mapping and response_format['type'] is not defined -%}
        {{- raise_exception('response_format: no "type"; supported types are ' ~ RF_TYPES ~ ', e.g. {"type": "json_object"}.') -}}
    {%- elif response_format is not mapping and response_format is not string -%}
        {{- raise_exception('response_format must be a dict such as {"type": "json_object"} or a type name, got ' ~ shown(response_format)) -}}
    {%- endif -%}
    {%- set rf_check = response_format['type'] if response_format is mapping else response_format -%}
    {%- if rf_check is not string or rf_check not in ('json_object', 'json_schema', 'text') -%}
        {{- raise_exception('Unsupported response_format type ' ~ shown(rf_check) ~ '; supported types are ' ~ RF_TYPES ~ '.') -}}
    {%- endif -%}
    {%- if rf_check == 'json_schema' -%}
        {%- set js_check = response_format['json_schema'] if response_format is mapping and response_format['json_schema'] is defined else none -%}
        {%- if js_check is not mapping -%}
            {{- raise_exception('response_format type "json_schema" needs "json_schema": a JSON object (dict) such as {"name": ..., "schema": {...}}, got ' ~ shown(js_check)) -}}
        {%- elif js_check['schema'] is defined and js_check['schema'] is not mapping -%}
            {{- raise_exception('response_format.json_schema.schema must be a JSON object (dict), got ' ~ shown(js_check['schema'])) -}}
        {%- elif js_check['schema'] is not defined and js_check['json_schema'] is defined and js_check['json_schema'] is not mapping -%}
            {{- raise_exception('response_format.json_schema.json_schema must be a JSON object (dict), got ' ~ shown(js_check['json_schema'])) -}}
        {%- endif -%}
    {%- endif -%}
{%- endif -%}
{#- ---- synthesized system notes ---- -#}
{%- if tools -%}
    {{- tool_declare(tools, false) -}}
{%- endif -%}
{%- if think_on and effort is not none -%}
    {%- if effort not in ('low', 'high', 'max') -%}
        {{- raise_exception('Unsupported thinking_effort=' ~ effort ~ "; supported values are ['high', 'low', 'max'].") -}}
    {%- endif -%}
    {{- note('thinking-effort', '`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort=' ~ effort ~ '`.') -}}
{%- endif -%}
{#- ---- the conversation ---- -#}
{%- set ns = namespace(calls=[], tool_index=0) -%}
{%- for message in messages -%}
    {%- set role = message['role'] -%}
    {%- if role == 'system' and message['tools'] is defined and message['tools'] -%}
        {{- check_tools(message['tools'], 'messages[' ~ loop.index0 ~ '].tools') -}}
        {{- tool_declare(message['tools'], true) -}}
    {%- elif role in ('user', 'system') -%}
        {{- OPEN }}message role="{{ role }}"
        {%- if message['name'] is defined and message['name'] %} name="{{ attr(message['name']) }}"{% endif -%}
        {{ SEP }}{{ content_of(message['content']) }}{{ CLOSE }}message{{ SEP }}{{ EOM -}}
    {%- elif role == 'assistant' -%}
        {%- set ns.calls = message['tool_calls'] if message['tool_calls'] is defined and message['tool_calls'] else [] -%}
        {%- set ns.tool_index = 0 -%}
        {{- OPEN }}message role="assistant"{{ SEP -}}
        {%- if think_on -%}
            {%- set reasoning = message['reasoning_content'] if message['reasoning_content'] is defined and message['reasoning_content'] else (message['reasoning'] if message['reasoning'] is defined and message['reasoning'] else '') -%}
            {{- OPEN }}think{{ SEP -}}
            {%- if reasoning is string and reasoning | trim -%}{{ user_text(reasoning) }}{%- endif -%}
            {{- CLOSE }}think{{ SEP -}}
        {%- endif -%}
        {{- OPEN }}response{{ SEP }}{{ content_of(message['content']) }}{{ CLOSE }}response{{ SEP -}}
        {%- if ns.calls -%}
            {{- OPEN }}tools{{ SEP -}}
            {%- for call in ns.calls -%}
                {%- set fn = call['function'] if call['function'] is defined else call -%}
                {{- OPEN }}call tool="{{ attr(fn['name']) }}" index="{{ loop.index }}"{{ SEP -}}
                {%- set args = fn['arguments'] if fn['arguments'] is defined and fn['arguments'] is not none else {} -%}
                {%- if args is string -%}
                    {%- if args | trim -%}
                        {{- OPEN }}json type="object"{{ SEP }}{{ user_text(args) }}{{ CLOSE }}json{{ SEP -}}
                    {%- endif -%}
                {%- elif args is mapping -%}
                    {%- for key, value in args.items() -%}
                        {{- OPEN }}argument key="{{ attr(key) }}" type="{{ xtml_type(value) }}"{{ SEP -}}
                        {{- user_text(value if value is string else value | tojson) -}}
                        {{- CLOSE }}argument{{ SEP -}}
                    {%- endfor -%}
                {%- else -%}
                    {{- raise_exception('Kimi K3 tool call arguments must be a dict or a JSON object string.') -}}
                {%- endif -%}
                {{- CLOSE }}call{{ SEP -}}
            {%- endfor -%}
            {{- CLOSE }}tools{{ SEP -}}
        {%- endif -%}
        {{- CLOSE }}message{{ SEP }}{{ EOM -}}
    {%- elif role == 'tool' -%}
        {%- set ns.tool_index = ns.tool_index + 1 -%}
        {%- set found = namespace(name=none) -%}
        {%- if message['tool_call_id'] is defined -%}
            {%- for call in ns.calls -%}
                {%- if found.name is none and call['id'] is defined and (call['id'] | string) == (message['tool_call_id'] | string) -%}
                    {%- set found.name = (call['function'] if call['function'] is defined else call)['name'] -%}
                {%- endif -%}
            {%- endfor -%}
        {%- endif -%}
        {%- if found.name is none and message['tool'] is defined -%}
            {%- set found.name = message['tool'] -%}
        {%- elif found.name is none and message['name'] is defined -%}
            {%- set found.name = message['name'] -%}
        {%- elif found.name is none and ns.tool_index <= ns.calls | length -%}
            {%- set call = ns.calls[ns.tool_index - 1] -%}
            {%- set found.name = (call['function'] if call['function'] is defined else call)['name'] -%}
        {%- endif -%}
        {%- if found.name is none -%}
            {{- raise_exception('Kimi K3 tool message has no resolvable tool name.') -}}
        {%- endif -%}
        {{- OPEN }}message role="tool" tool="{{ attr(found.name) }}" index="{{ ns.tool_index }}"{{ SEP -}}
        {{- content_of(message['content']) }}{{ CLOSE }}message{{ SEP }}{{ EOM -}}
    {%- else -%}
        {{- raise_exception('Kimi K3 chat template: unknown role "' ~ role ~ '"') -}}
    {%- endif -%}
{%- endfor -%}
{#- ---- request notes, then the floor goes to the assistant ---- -#}
{%- if tool_choice is defined and tool_choice in ('required', 'none') -%}
    {{- note('tool-choice', 'The system is invoked with `tool_choice=' ~ tool_choice ~ '`.\nYou MUST ' ~ ('call tools' if tool_choice == 'required' else 'NOT call any tools') ~ ' in the next message.') -}}
{%- endif -%}
{%- if response_format is defined and response_format is not none -%}
    {%- set rf_type = response_format['type'] if response_format is mapping else response_format -%}
    {%- set rf_note = 'Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting.' -%}
    {%- if rf_type == 'json_object' -%}
        {{- note('response-format', 'The system is invoked with `response_format=json_object`.\n' ~ rf_note) -}}
    {%- elif rf_type == 'json_schema' -%}
        {%- set js = response_format['json_schema'] if response_format is mapping and response_format['json_schema'] is defined else none -%}
        {%- if js is mapping and js['schema'] is defined -%}{%- set schema = js['schema'] -%}
        {%- elif js is mapping and js['json_schema'] is defined -%}{%- set schema = js['json_schema'] -%}
        {%- else -%}{%- set schema = js -%}{%- endif -%}
        {{- note('response-format', 'The system is invoked with `response_format=json_schema`.\n' ~ rf_note ~ '\nThe JSON data must match the following schema:\n```json\n' ~ user_text(schema | tojson(separators=(',', ':'), sort_keys=true)) ~ '\n```') -}}
    {%- endif -%}
{%- endif -%}
{%- if add_generation_prompt -%}
    {{- OPEN }}message role="assistant"{{ SEP }}{{ OPEN }}{{ 'think' if think_on else 'response' }}{{ SEP -}}
{%- endif -%}
"""


def _jinja_constant(name: str, value: str) -> str:
    """A Jinja ``set`` line binding ``name`` to the string ``value``."""
    return "{%- set " + name + " = '" + value + "' -%}\n"


CHAT_TEMPLATE = (
    "{#- Kimi K3 chat template (XTML). See processing_kimi3.py for the format. -#}\n"
    + _jinja_constant("OPEN", OPEN_TOKEN)
    + _jinja_constant("CLOSE", CLOSE_TOKEN)
    + _jinja_constant("SEP", SEP_TOKEN)
    + _jinja_constant("EOM", END_OF_MSG_TOKEN)
    + _jinja_constant("IMAGE", IMAGE_PROMPT)
    + _CHAT_TEMPLATE_BODY
)


__all__ = [
    "BOS_TOKEN",
    "BYTE_DECODER",
    "BYTE_ENCODER",
    "CHAT_TEMPLATE",
    "CLOSE_TOKEN",
    "END_HEADER_TOKEN",
    "END_OF_MSG_TOKEN",
    "EOS_TOKEN",
    "EOT_TOKEN",
    "IMAGE_PROMPT",
    "K3_SPECIAL_TOKEN_OFFSETS",
    "KIMI_IMAGE_PLACEHOLDER",
    "MEDIA_BEGIN_TOKEN",
    "MEDIA_CONTENT_TOKEN",
    "MEDIA_END_TOKEN",
    "MEDIA_PAD_TOKEN",
    "NUM_RESERVED_SPECIAL_TOKENS",
    "OPEN_TOKEN",
    "OSAGENT_MODE_TOKEN",
    "PAD_TOKEN",
    "PAT_STR",
    "RESERVED_TOKEN_PREFIX",
    "SEP_TOKEN",
    "START_HEADER_TOKEN",
    "UNK_TOKEN",
    "bytes_to_unicode",
    "load_tiktoken_ranks",
    "reserved_token_name",
    "save_tiktoken_ranks",
    "tiktoken_ranks_from_fast",
    "token_bytes_to_string",
]
