"""Writes cases.json: model output texts for the reasoning/tool parsers, grouped by the vLLM
parser pair that serves the model (`--reasoning-parser` / `--tool-call-parser`)."""
import json

W = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city"]}}}
S = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "opts": {"type": "object"}}}}}
TOOLS = [W, S]

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, CA, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def kcall(name, idx, args):
    return f"{CB}functions.{name}:{idx}{CA}{args}{CE}"


kimi = [
    "<think>Let me check the weather.</think>I'll look it up." + SB + kcall("get_weather", 0, '{"city": "Beijing"}') + SE,
    "<think>Two cities.</think>" + SB + kcall("get_weather", 0, '{"city": "Beijing"}') + kcall("get_weather", 1, '{"city": "Tokyo", "unit": "c"}') + SE,
    "The user wants the weather.</think>Sure, here it is.",
    "<think>still thinking about it",
    "<think>I should call a tool" + SB + kcall("get_weather", 0, '{"city":"Paris"}') + SE,
    "<think></think>Hello there!",
    "<think>Thinking.\n\n</think>\n\n" + SB + kcall("search", 0, '{"query": "Zürich \\"quoted\\"", "opts": {"n": [1, 2]}}') + SE,
    "<think>ok</think>Answer first." + SB + kcall("get_weather", 3, ' {"city": "Oslo"} ') + SE + " trailing",
    "No reasoning markers at all, just text.",
    "<think>a</think>b</think>c",
]
hermes = [
    "<think>\nNeed weather.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"café \\\"x\\\"\", \"opts\": {\"n\": [1, 2.5]}}}\n</tool_call>",
    "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\", \"unit\": \"f\"}}\n</tool_call>",
    "<think>hmm</think>The answer is 4.",
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>",
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}",
    "reasoning without a start tag</think>the answer",
    "Plain answer, no tools.",
    "<tool_call>{\"name\": \"search\", \"arguments\": {}}</tool_call>",
]
r1 = [
    "<think>abc</think>def",
    "abc</think>def",
    "<think>abc",
    "abc",
    "<think>a</think>",
    "<think>\nstep 1\nstep 2\n</think>\n\nThe answer is **42**.",
]

cases = []
for t in kimi:
    cases.append({"reasoning_parser": "kimi_k2", "tool_parser": "kimi_k2", "tools": TOOLS, "text": t})
cases.append({"reasoning_parser": "kimi_k2", "tool_parser": "kimi_k2", "tools": TOOLS, "text": "Hi <think>not reasoning</think> there",
              "chat_template_kwargs": {"thinking": False}})
for t in hermes:
    cases.append({"reasoning_parser": "qwen3", "tool_parser": "hermes", "tools": TOOLS, "text": t})
    cases.append({"reasoning_parser": None, "tool_parser": "hermes", "tools": TOOLS, "text": t})
cases.append({"reasoning_parser": "qwen3", "tool_parser": "hermes", "tools": TOOLS, "text": "Direct answer.",
              "chat_template_kwargs": {"enable_thinking": False}})
for t in r1:
    cases.append({"reasoning_parser": "deepseek_r1", "tool_parser": None, "tools": [], "text": t})
    cases.append({"reasoning_parser": "qwen3", "tool_parser": None, "tools": [], "text": t})

# Kimi K3 "XTML" (docs/formats.md 4.2): <|open|>, <|close|>, <|sep|> are special tokens, tag names
# and attributes ordinary text. The generation prompt opens the think channel, so the output
# starts inside it.
O, C, S = "<|open|>", "<|close|>", "<|sep|>"


def xopen(tag, attrs=""):
    return f"{O}{tag}{(' ' + attrs) if attrs else ''}{S}"


def xclose(tag):
    return f"{C}{tag}{S}"


def k3call(name, index, args):
    body = "".join(xopen("argument", f'key="{k}" type="{t}"') + v + xclose("argument") for k, t, v in args)
    return xopen("call", f'tool="{name}" index="{index}"') + body + xclose("call")


def k3tools(*calls):
    return xopen("tools") + "".join(calls) + xclose("tools")


def resp(t):
    return xopen("response") + t + xclose("response")


THINK_END = xclose("think")
MSG_END = xclose("message")
# Each call below is closed unless the case says `truncated_call` (a stream has sent it already).
k3 = [
    "Let me check the weather." + THINK_END + resp("I'll look it up.") + k3tools(k3call("get_weather", 1, [("city", "string", "Beijing")])) + MSG_END,
    "Two cities." + THINK_END + k3tools(k3call("get_weather", 1, [("city", "string", "Beijing")]),
                                      k3call("get_weather", 2, [("city", "string", "Tokyo"), ("unit", "string", "c")])) + MSG_END,
    "still thinking about it",
    xopen("think") + "Explicit open." + THINK_END + resp("Hello there!") + MSG_END,
    "Typed." + THINK_END + resp("") + k3tools(k3call("search", 1, [("query", "string", 'Zürich "quoted" <b> & \\n'),
                                                                  ("opts", "object", '{"n": [1, 2.50], "deep": {"x": null}}')])),
    "Types." + THINK_END + k3tools(k3call("lookup", 1, [("n", "integer", "42"), ("x", "number", "2.50"), ("ok", "boolean", "true"),
                                                       ("bad", "integer", "abc"), ("a&amp;b", "string", "1 &amp; 2"), ("q&quot;k", "array", "[1,\n 2]")])),
    "思考中。" + THINK_END + resp("天地玄黄，宇宙洪荒。") + MSG_END,
    "Truncated answer." + THINK_END + xopen("response") + "The answer is",
    "Plain after think." + THINK_END + "no response wrapper here",
    "Empty call name." + THINK_END + k3tools(k3call("", 1, [("city", "string", "x")]), k3call("get_weather", 2, [("city", "string", "Oslo")])),
    "Unclosed call." + THINK_END + k3tools(k3call("get_weather", 1, [("city", "string", "Rome")])) [:-len(xclose("call")) - len(xclose("tools"))],
    "No args." + THINK_END + resp("Calling.") + k3tools(xopen("call", 'tool="search" index="1"') + xclose("call")) + MSG_END,
    "Multi\nline\n" + THINK_END + "\n" + resp("\nline one\nline two\n") + "\n" + MSG_END,
]
for t in k3:
    c = {"reasoning_parser": "kimi_k3", "tool_parser": "kimi_k3", "tools": TOOLS, "text": t}
    if t.startswith("Unclosed call."):
        c["truncated_call"] = True
    cases.append(c)
for t in (k3[0], k3[3], k3[6], k3[7], k3[8]):
    # No tools offered: the reasoning parser unwraps the response channel itself.
    cases.append({"reasoning_parser": "kimi_k3", "tool_parser": None, "tools": [], "text": t})
cases.append({"reasoning_parser": "kimi_k3", "tool_parser": "kimi_k3", "tools": TOOLS, "text": resp("Instruct mode.") + MSG_END,
              "chat_template_kwargs": {"thinking": False}})
cases.append({"reasoning_parser": "kimi_k3", "tool_parser": None, "tools": [], "text": resp("Instruct mode.") + MSG_END,
              "chat_template_kwargs": {"thinking": False}})

# Qwen3-Coder XML tool calls (vLLM `qwen3_coder`): values converted with the tool's JSON schema.
T = {"type": "function", "function": {"name": "typed", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "integer"}},
    "cfg": {"type": "object"}, "s": {"type": "string"}, "maybe": {"type": ["integer", "null"]}, "color": {"enum": ["red", "green"]}}}}}
QTOOLS = TOOLS + [T]


def qcall(name, params):
    return "<tool_call>\n<function=" + name + ">\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params) + "</function>\n</tool_call>"


qwen_xml = [
    "<think>\nNeed weather.\n</think>\n\n" + qcall("get_weather", [("city", "Paris")]),
    "Let me check.\n" + qcall("get_weather", [("city", "Rome"), ("unit", "f")]) + "\n" + qcall("search", [("query", 'café "x"\nline 2'), ("opts", '{"n": [1, 2.5]}')]),
    qcall("typed", [("n", "42"), ("x", "2.50"), ("ok", "True"), ("tags", "[1, 2]"), ("cfg", '{"a": {"b": null}}'), ("s", "007"), ("maybe", "null"), ("color", "red")]),
    qcall("typed", [("n", "4.5"), ("x", "3"), ("ok", "maybe"), ("tags", "not json"), ("maybe", "12")]),
    qcall("undeclared_tool", [("a", "1"), ("b", "x")]),
    "<think>hmm</think>" + qcall("get_weather", [("city", "Oslo")])[:-len("</function>\n</tool_call>")],
    "<tool_call>\n<function=search>\n</function>\n</tool_call>",
    "Plain answer, no tools.",
]
# (vLLM's qwen3_coder drops Qwen3's JSON calls; the `qwen3` plugin takes those as `hermes` does,
# so its JSON-form reference is the hermes cases above.)
for t in qwen_xml:
    cases.append({"reasoning_parser": "qwen3", "tool_parser": "qwen3_coder", "tools": QTOOLS, "text": t})
    cases.append({"reasoning_parser": None, "tool_parser": "qwen3_coder", "tools": QTOOLS, "text": t})
cases.append({"reasoning_parser": "qwen3", "tool_parser": "qwen3_coder", "tools": QTOOLS, "text": "Direct answer.\n" + qcall("search", [("query", "x")]),
              "chat_template_kwargs": {"enable_thinking": False}})
json.dump(cases, open("cases.json", "w"), ensure_ascii=False, indent=1)
print(len(cases), "cases")
