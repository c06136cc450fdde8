"""The chat template refuses what it cannot render: malformed tool schemas, unknown tool_choice / response_format.

The checks live in the template (:data:`special_tokens.CHAT_TEMPLATE`, saved as ``chat_template.jinja``), next to the
``thinking_effort`` check, so every loader of a K3 folder gets them: the plain tokenizer that ``AutoTokenizer`` loads
and the processor alike. The template refuses through Transformers' ``raise_exception``, a ``jinja2.TemplateError``.
"""

import os

import pytest
from jinja2.exceptions import TemplateError
from transformers import AutoProcessor, AutoTokenizer

import transformers_kimi3  # noqa: F401  registers Kimi3Processor with AutoProcessor
from kimi3_testing import ROOT
from transformers_kimi3.special_tokens import CHAT_TEMPLATE

TINY = os.path.join(ROOT, "assets", "kimi-k3-tiny")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SEARCH = {"type": "builtin_function", "function": {"name": "$web_search"}}  # no description, no parameters
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def get_time(tz: str) -> str:
    """Get the time.

    Args:
        tz: The time zone.
    """


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY)


@pytest.fixture(scope="module")
def processor():
    return AutoProcessor.from_pretrained(TINY)


@pytest.fixture(params=["tokenizer", "processor"])
def render(request, tokenizer, processor):
    owner = tokenizer if request.param == "tokenizer" else processor

    def _render(messages=MESSAGES, **kwargs):
        return owner.apply_chat_template(messages, tokenize=False, thinking_effort=None, **kwargs)

    return _render


def test_the_bundled_template_is_the_package_template(tokenizer, processor):
    assert tokenizer.chat_template == CHAT_TEMPLATE and processor.chat_template == CHAT_TEMPLATE


# The prompt for valid input, as rendered by the template before it had these checks.
EXPECTED = (
    '<|open|>message role="system" type="tool-declare"<|sep|># Tools\nHere are the available tools, described in '
    'JSONSchema.\n\n```json\n[{"function":{"description":"Get weather","name":"get_weather","parameters":'
    '{"properties":{"city":{"type":"string"}},"required":["city"],"type":"object"}},"type":"function"},'
    '{"function":{"description":"Get the time.","name":"get_time","parameters":{"properties":{"tz":'
    '{"description":"The time zone.","type":"string"}},"required":["tz"],"type":"object"},"return":'
    '{"type":"string"}},"type":"function"},{"function":{"name":"$web_search"},"type":"builtin_function"}]\n```'
    "<|close|>message<|sep|><|end_of_msg|>"
    '<|open|>message role="user"<|sep|>Weather in Paris?<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="system" type="tool-choice"<|sep|>The system is invoked with `tool_choice=required`.\n'
    "You MUST call tools in the next message.<|close|>message<|sep|><|end_of_msg|>"
    '<|open|>message role="system" type="response-format"<|sep|>The system is invoked with '
    "`response_format=json_schema`.\nYour response must be raw JSON data without markdown code blocks (```json) or "
    "any additional formatting.\nThe JSON data must match the following schema:\n```json\n{\"type\":\"object\"}\n```"
    "<|close|>message<|sep|><|end_of_msg|>"
    '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
)


def test_valid_requests_render_unchanged(render):
    # OpenAI-style tools, a Python function (Transformers' get_json_schema) and a tool without description/parameters
    out = render(tools=[WEATHER, get_time, SEARCH], tool_choice="required", add_generation_prompt=True,
                 response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}})
    assert out == EXPECTED
    plain = render()
    # the defaults render nothing, as before
    for kwargs in (dict(tool_choice="auto"), dict(tool_choice=None), dict(response_format="text"),
                   dict(response_format={"type": "text"}), dict(response_format=None), dict(tools=[]),
                   dict(tools=None)):
        assert render(**kwargs) == plain, kwargs
    # the other accepted response_format spellings
    assert "`response_format=json_object`" in render(response_format="json_object")
    bare = render(response_format={"type": "json_schema", "json_schema": {"type": "object"}})
    assert bare == render(response_format={"type": "json_schema", "json_schema": {"json_schema": {"type": "object"}}})
    assert bare.endswith('{"type":"object"}\n```<|close|>message<|sep|><|end_of_msg|>')
    # a tool's own extra keys are declared as given
    assert '"strict":true' in render(tools=[{"type": "function", "strict": True, "function": {"name": "f"}}])


TOOL_FORM = '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}'


@pytest.mark.parametrize("kwargs,message", [
    (dict(tools=[WEATHER, WEATHER, {"type": "function", "name": "f", "parameters": {}}]),
     f'tools[2]: no "function"; a tool is {TOOL_FORM}'),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]),
     'tools[0].function: "name" must be a non-empty string, got nothing'),
    (dict(tools=[{"type": "function", "function": {"name": "  "}}]),
     'tools[0].function: "name" must be a non-empty string, got "  "'),
    (dict(tools=[{"type": "function", "function": {"name": 7}}]),
     'tools[0].function: "name" must be a non-empty string, got int'),
    (dict(tools=[WEATHER, {"type": "function", "function": {"name": "f", "parameters": [{"type": "object"}]}}]),
     "tools[1].function.parameters must be a JSON object (dict), got list"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]),
     'tools[0].function.parameters must be a JSON object (dict), got "{}"'),
    (dict(tools=[{"type": "function", "function": {"name": "f", "description": ["d"]}}]),
     "tools[0].function.description must be a string, got list"),
    (dict(tools=[{"type": "function", "function": "get_weather"}]),
     'tools[0].function must be a JSON object (dict), got "get_weather"'),
    (dict(tool_choice="any"),
     "Unsupported tool_choice=\"any\"; supported values are ['auto', 'none', 'required']."),
    (dict(tool_choice=True),
     "Unsupported tool_choice=True; supported values are ['auto', 'none', 'required']."),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
     "the template cannot force a named tool; supported values are ['auto', 'none', 'required']"),
    (dict(response_format={"type": "xml"}),
     "Unsupported response_format type \"xml\"; supported types are ['json_object', 'json_schema', 'text']."),
    (dict(response_format="json"),
     "Unsupported response_format type \"json\"; supported types are ['json_object', 'json_schema', 'text']."),
    (dict(response_format={"json_schema": {"schema": {}}}),
     "response_format: no \"type\"; supported types are ['json_object', 'json_schema', 'text']"),
    (dict(response_format=["json_object"]),
     'response_format must be a dict such as {"type": "json_object"} or a type name, got list'),
    (dict(response_format={"type": "json_schema"}),
     'response_format type "json_schema" needs "json_schema": a JSON object (dict) such as {"name": ..., '
     '"schema": {...}}, got None'),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": "object"}}),
     'response_format.json_schema.schema must be a JSON object (dict), got "object"'),
])
def test_bad_requests_are_refused(render, kwargs, message):
    with pytest.raises(TemplateError) as err:
        render(**kwargs)
    assert message in str(err.value)


def test_bad_dynamic_tools_name_the_message(render):
    messages = [{"role": "user", "content": "hi"},
                {"role": "system", "tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": 3}}]}]
    with pytest.raises(TemplateError, match=r"messages\[1\]\.tools\[1\]\.function\.parameters must be a JSON object "
                                            r"\(dict\), got int"):
        render(messages)
