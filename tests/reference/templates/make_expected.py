"""Renders each chat template here (and SmolLM2's, from ../smollm2/fixtures.json) with
transformers' own renderer (`render_jinja_template`, what `apply_chat_template` uses) for a few
conversations, and writes expected.json: the byte-exact prompts the chat-template-jinja plugin
must reproduce. Run with the reference venv (scripts/setup-reference-venv):

    .venv/bin/python tests/reference/templates/make_expected.py
"""
import glob
import json
import os

import transformers
from transformers.utils.chat_template_utils import render_jinja_template

HERE = os.path.dirname(os.path.abspath(__file__))
BOS_EOS = {
    "deepseek": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "SmolLM2": ("<|im_start|>", "<|im_end|>"),
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time in a time zone",
                                        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
# Template options (chat_template_kwargs / reasoning_effort, passed to the template as variables
# the way vLLM passes them), each rendered with the conversations in KWARGS_CONVERSATIONS.
# The templates read different names: Qwen3/SmolLM3 enable_thinking, DeepSeek-V3.x and Kimi K3
# thinking, Kimi K3 thinking_effort (it refuses 'medium').
KWARGS = [{"enable_thinking": False}, {"enable_thinking": True}, {"thinking": True}, {"thinking": False},
          {"reasoning_effort": "high"}, {"thinking_effort": "low"}, {"thinking_effort": "medium"}, {"thinking": False, "tool_choice": "auto"}]
KWARGS_CONVERSATIONS = ["reasoning", "tools_multi_turn"]
CONVERSATIONS = {
    "single_user": {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    "multi_turn": {"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "How are you? ünïcödé \"quotes\""},
    ]},
    "tools": {"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": "18°C, sunny"},
    ]},
    # Two calls in one turn, their results, the final answer and a follow-up question.
    "tools_multi_turn": {"tools": [WEATHER, TIME], "messages": [
        {"role": "system", "content": "You answer with tools."},
        {"role": "user", "content": "Weather and time in Zürich?"},
        {"role": "assistant", "content": "Checking both.", "reasoning_content": "Two tools are needed.", "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
            {"id": "functions.get_time:1", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "Europe/Zurich"}}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": "{\"temp\": 18, \"sky\": \"sunny\"}"},
        {"role": "tool", "tool_call_id": "functions.get_time:1", "name": "get_time", "content": "14:05"},
        {"role": "assistant", "content": "18°C and sunny; it is 14:05.", "reasoning_content": "Both results are in."},
        {"role": "user", "content": "And tomorrow?"},
    ]},
    "reasoning": {"messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two plus two is four."},
        {"role": "user", "content": "And 3+3?"},
    ]},
}


def templates():
    smol = json.load(open(os.path.join(HERE, "..", "smollm2", "fixtures.json")))["chat_template"]
    yield "SmolLM2-135M-Instruct", smol
    for p in sorted(glob.glob(os.path.join(HERE, "*.jinja"))):
        yield os.path.basename(p)[: -len(".jinja")], open(p, encoding="utf-8").read()


def renderings():
    """(conversation name, add_generation_prompt, kwargs) for every rendering of a template."""
    for conv in CONVERSATIONS:
        for gen in (True, False):
            yield conv, gen, {}
    for conv in KWARGS_CONVERSATIONS:
        for kwargs in KWARGS:
            yield conv, True, kwargs


def main():
    out = []
    for name, src in templates():
        bos, eos = next((v for k, v in BOS_EOS.items() if k in name), ("", ""))
        for conv, gen, kwargs in renderings():
            c = CONVERSATIONS[conv]
            if True:
                try:
                    prompt = render_jinja_template(conversations=[c["messages"]], tools=c.get("tools"), chat_template=src,
                                                   add_generation_prompt=gen, bos_token=bos, eos_token=eos, **kwargs)[0][0]
                except Exception as e:  # the template refuses this conversation: the plugin must too
                    prompt, err = None, f"{type(e).__name__}: {e}"
                else:
                    err = None
                out.append({"template": name, "conversation": conv, "add_generation_prompt": gen, "kwargs": kwargs, "bos_token": bos, "eos_token": eos,
                            "messages": c["messages"], "tools": c.get("tools"), "prompt": prompt, "error": err})
    json.dump({"transformers": transformers.__version__, "cases": out}, open(os.path.join(HERE, "expected.json"), "w"),
              ensure_ascii=False, indent=1)
    print(len(out), "renderings,", sum(o["error"] is not None for o in out), "refused")


if __name__ == "__main__":
    main()
