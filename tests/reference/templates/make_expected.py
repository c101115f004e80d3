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


def main():
    out = []
    for name, src in templates():
        bos, eos = next((v for k, v in BOS_EOS.items() if k in name), ("", ""))
        for conv, c in CONVERSATIONS.items():
            for gen in (True, False):
                try:
                    prompt = render_jinja_template(conversations=[c["messages"]], tools=c.get("tools"), chat_template=src,
                                                   add_generation_prompt=gen, bos_token=bos, eos_token=eos)[0][0]
                except Exception as e:  # the template refuses this conversation: the plugin must too
                    prompt, err = None, f"{type(e).__name__}: {e}"
                else:
                    err = None
                out.append({"template": name, "conversation": conv, "add_generation_prompt": gen, "bos_token": bos, "eos_token": eos,
                            "messages": c["messages"], "tools": c.get("tools"), "prompt": prompt, "error": err})
    json.dump({"transformers": transformers.__version__, "cases": out}, open(os.path.join(HERE, "expected.json"), "w"),
              ensure_ascii=False, indent=1)
    print(len(out), "renderings,", sum(o["error"] is not None for o in out), "refused")


if __name__ == "__main__":
    main()
