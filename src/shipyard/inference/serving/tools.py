"""Tool calling: OpenAI ``tools`` rendered into the prompt, the model's tool calls parsed out.

Contract: :func:`tool_template` picks how a tokenizer's model calls tools, once per tokenizer:

- a chat template that renders ``tools`` itself is used as it is, and its format is read from
  its text: ``hermes`` where it mentions ``<tool_call>`` (Hermes 2 Pro, Qwen 2.5/3), else
  ``llama3_json`` (Llama 3.1/3.2: the whole reply is one JSON object, ``parameters`` or
  ``arguments``, optionally after ``<|python_tag|>``);
- a ChatML template without tools (SmolLM2-135M-Instruct's) is replaced by
  :data:`HERMES_CHATML`, Shipyard's documented Hermes rendering (docs/harnesses.md): the tool
  schemas go into the system turn inside ``<tools></tools>``, one JSON object per line, with
  the instruction to answer ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
  an assistant turn with ``tool_calls`` is rendered the same way and consecutive ``tool``
  messages go into one user turn as ``<tool_response>`` blocks (Qwen 2.5's layout). Without
  tools and tool messages it renders exactly as the model's own template (the model's default
  system prompt is carried over), so plain chats are unchanged. The same file is what a vLLM
  server gets as ``--chat-template``, with ``--tool-call-parser hermes``: both backends render
  the same prompt and read the same calls out of the same sampled ids;
- any other template without tools: :func:`tool_template` raises ValueError naming the model.

:func:`parse_tool_calls` mirrors vLLM's ``hermes`` and ``llama3_json`` parsers on a whole
reply: the content before the first ``<tool_call>`` (None when empty) and one call per block,
``arguments`` re-serialized with ``json.dumps(..., ensure_ascii=False)``. A reply that does not
parse (bad JSON, no ``name``) comes back whole as content with ``ok=False``, never an error.

:func:`chat_messages` turns OpenAI request messages into template messages: list content joined,
``tool_calls`` arguments decoded from their JSON strings (templates expect objects),
``tool_call_id``/``name`` kept; roles outside system/user/assistant/tool/developer are refused.
:func:`canonical_assistant` is the form two renderings of the same assistant message share
(content, call names and arguments as canonical JSON), which the session endpoint matches on.

Limits: ``tool_choice`` ``required`` and a named function are honoured by prefilling the opening
of the call (``<tool_call>\\n`` and ``{"name": "f", "arguments": ``) rather than by constrained
decoding: the arguments may still fail to parse (counted). vLLM constrains them with structured
outputs instead, so only ``auto`` and ``none`` sample the same ids on both backends.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

ToolFormat = Literal["hermes", "llama3_json"]

ROLES = ("system", "developer", "user", "assistant", "tool")
"""Message roles a chat request may carry."""

HERMES_CHATML = """\
{%- set default_system = __DEFAULT_SYSTEM__ -%}
{%- if messages and messages[0].role in ('system', 'developer') -%}
{%- set system = messages[0].content -%}{%- set rest = messages[1:] -%}
{%- else -%}{%- set system = default_system -%}{%- set rest = messages -%}{%- endif -%}
{%- if tools -%}
{{- '<|im_start|>system\\n' + (system or '') + '\\n\\n# Tools\\n\\nYou may call one or more functions to \
assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML \
tags:\\n<tools>' -}}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments \
within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": \
<args-json-object>}\\n</tool_call><|im_end|>\\n' -}}
{%- elif system is not none -%}
{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in rest -%}
{%- if message.role == 'assistant' and message.tool_calls -%}
{{- '<|im_start|>assistant' -}}
{%- if message.content -%}{{- '\\n' + message.content -}}{%- endif -%}
{%- for call in message.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' -}}
{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
{{- '}\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or rest[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}
{%- if loop.last or rest[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
{%- else -%}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""
"""Shipyard's Hermes rendering for ChatML models without tools (module doc); ``__DEFAULT_SYSTEM__``
is replaced by the model's default system prompt (a Jinja string literal, or ``none``)."""

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(?!.*</tool_call>)(.*)", re.DOTALL)


@dataclass(frozen=True)
class ToolTemplate:
    """How one model calls tools: its format and the chat template to render tool requests with."""

    format: ToolFormat
    template: str
    """The Jinja chat template (the model's own, or :data:`HERMES_CHATML` filled in)."""
    native: bool
    """Whether ``template`` is the model's own (False: Shipyard's Hermes rendering)."""


@dataclass
class ToolCall:
    name: str
    arguments: str
    """The arguments as a JSON string (OpenAI's shape)."""
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParsedReply:
    content: str | None
    tool_calls: list[ToolCall]
    ok: bool = True
    """False when the reply tried to call a tool (a start tag, a JSON object) but did not parse."""


def tool_template(tokenizer: Any) -> ToolTemplate:
    """The tool template of ``tokenizer``'s model (module doc); cached on the tokenizer."""
    cached = getattr(tokenizer, "_shipyard_tool_template", None)
    if cached is not None:
        return cached
    own = tokenizer.chat_template
    if not isinstance(own, str) or not own:
        raise ValueError(
            f"tools: the model {tokenizer.name_or_path!r} has no chat template to render tools with"
        )
    if "tools" in own:
        fmt: ToolFormat = "hermes" if HERMES_START in own else "llama3_json"
        found = ToolTemplate(fmt, own, native=True)
    elif "<|im_start|>" in own:
        found = ToolTemplate("hermes", hermes_chatml(tokenizer), native=False)
    else:
        raise ValueError(
            f"tools: the chat template of {tokenizer.name_or_path!r} renders no tools and is not ChatML; "
            "give the model a template with tools (transformers' chat_template) to call tools"
        )
    tokenizer._shipyard_tool_template = found
    return found


def default_system(tokenizer: Any) -> str | None:
    """The system prompt ``tokenizer``'s ChatML template adds when a chat has none (None: none)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "\x00"}], tokenize=False)
    head = text[: text.index("<|im_start|>user")]
    match = re.fullmatch(r"<\|im_start\|>system\n(.*)<\|im_end\|>\n", head, re.DOTALL)
    if head and match is None:
        raise ValueError(f"tools: cannot read the default system turn of {tokenizer.name_or_path!r}")
    return match.group(1) if match else None


def hermes_chatml(tokenizer: Any) -> str:
    """:data:`HERMES_CHATML` with ``tokenizer``'s default system prompt filled in."""
    system = default_system(tokenizer)
    return HERMES_CHATML.replace("__DEFAULT_SYSTEM__", "none" if system is None else json.dumps(system))


def parse_tool_calls(text: str, fmt: ToolFormat) -> ParsedReply:
    """The content and tool calls of a whole reply ``text`` (module doc)."""
    return _parse_hermes(text) if fmt == "hermes" else _parse_llama3(text)


def _call(obj: Any) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a tool call needs a string name")
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _parse_hermes(text: str) -> ParsedReply:
    if HERMES_START not in text:
        return ParsedReply(text, [])
    try:
        calls = [_call(json.loads(closed or open_)) for closed, open_ in _HERMES_BLOCK.findall(text)]
    except ValueError:  # json.JSONDecodeError is one
        return ParsedReply(text, [], ok=False)
    content = text[: text.index(HERMES_START)]
    return ParsedReply(content or None, calls)


def _parse_llama3(text: str) -> ParsedReply:
    body = text.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedReply(text, [])
    try:
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            obj, end = decoder.raw_decode(body, pos)
            calls.append(_call(obj))
            pos = end
            while pos < len(body) and body[pos] in "; \n\t":
                pos += 1
    except ValueError:
        return ParsedReply(text, [], ok=False)
    return ParsedReply(None, calls)


def forced_prefix(tool_choice: Any, fmt: ToolFormat) -> str:
    """Text the reply is made to start with for ``tool_choice`` (module doc's limits); "" for
    ``auto``/``none``."""
    if tool_choice in (None, "auto", "none"):
        return ""
    if fmt != "hermes":
        raise ValueError("tool_choice: 'required' and named functions need a Hermes-format model here")
    if tool_choice == "required":
        return HERMES_START + "\n"
    name = tool_choice["function"]["name"]
    return HERMES_START + '\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ValueError(f"{where}.content[{j}]: only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"{where}.content: expected a string, a list of text parts or null")


def _decoded(args: Any) -> Any:
    """Arguments as an object where they are a JSON string of one; else as given."""
    if not isinstance(args, str):
        return args
    with contextlib.suppress(json.JSONDecodeError):
        return json.loads(args) if args.strip() else {}
    return args


def _template_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{where}: a tool call needs function.name")
    args = _decoded(fn.get("arguments", "{}"))  # undecodable: rendered as the string it is
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def chat_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """OpenAI request messages as template messages (module doc); ValueError naming the message."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else None
            raise ValueError(f"{where}.role: {role!r} is not one of {', '.join(ROLES)}")
        role = "system" if m["role"] == "developer" else m["role"]
        content = _text(m.get("content"), where)
        msg: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = [
                _template_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(m["tool_calls"])
            ]
        elif content is None:
            raise ValueError(f"{where}.content: a {role} message needs text content")
        if role == "tool":
            msg["content"] = content or ""
            msg["tool_call_id"] = m.get("tool_call_id")
        if m.get("name") is not None:
            msg["name"] = m["name"]
        out.append(msg)
    return out


def canonical_assistant(content: str | None, tool_calls: list[dict[str, Any]] | None) -> str:
    """One string for an assistant message however a client re-serialized it: content stripped,
    each call's name and arguments as canonical JSON (ids and key order ignored)."""
    calls = []
    for call in tool_calls or []:
        fn = call.get("function", call)
        args = _decoded(fn.get("arguments"))
        calls.append([fn.get("name"), json.dumps(args, sort_keys=True, ensure_ascii=False)])
    return json.dumps([(content or "").strip(), calls], ensure_ascii=False)


def check_tools(tools: Any, tool_choice: Any) -> list[dict[str, Any]]:
    """``tools`` validated (OpenAI function tools) and ``tool_choice`` checked against them;
    ValueError naming the field."""
    if not isinstance(tools, list):
        raise ValueError("tools: expected a list of {type: function, function: {name, parameters}}")
    names = []
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{k}]: only {{type: function, function: {{...}}}} tools are supported")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{k}].function.name: a non-empty string is required")
        names.append(fn["name"])
    if tool_choice in (None, "auto", "none"):
        return tools
    if tool_choice == "required":
        if not tools:
            raise ValueError("tool_choice: 'required' needs at least one tool in tools")
        return tools
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (
        not isinstance(fn, dict)
        or tool_choice.get("type") != "function"
        or not isinstance(fn.get("name"), str)
    ):
        raise ValueError(
            "tool_choice: expected 'auto', 'none', 'required' or {type: function, function: {name}}"
        )
    if fn["name"] not in names:
        raise ValueError(f"tool_choice: function {fn['name']!r} is not among tools ({', '.join(names)})")
    return tools
