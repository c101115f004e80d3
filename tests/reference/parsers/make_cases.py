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
json.dump(cases, open("cases.json", "w"), ensure_ascii=False, indent=1)
print(len(cases), "cases")
