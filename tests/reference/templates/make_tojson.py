"""Writes tojson_expected.json: what transformers' `tojson` template filter (Python's
`json.dumps` with the template's keyword arguments) writes for awkward values — non-ASCII
(BMP and astral), every escape, DEL and U+2028, HTML characters, key order, floats at the
edges of Python's repr — under `ensure_ascii`, `indent`, `separators` and `sort_keys`.

Each case is a one-line template `{{ value | tojson(...) }}` rendered by transformers'
own renderer (`render_jinja_template`, what `apply_chat_template` uses) with the value passed
as a template variable; the script also checks that equals `json.dumps` called directly.
The host's native renderer and the chat-template-jinja plugin must reproduce `expected`.
Run with the reference venv:

    .venv/bin/python tests/reference/templates/make_tojson.py
"""
import json
import os

import transformers
from transformers.utils.chat_template_utils import render_jinja_template

HERE = os.path.dirname(os.path.abspath(__file__))

VALUES = {
    "non_ascii": {"city": "Zürich", "zh": "北京天气", "emoji": "ok 😀", "é": "clé"},
    "escapes": ["quote \" backslash \\ slash /", "nl\ncr\rtab\tbs\bff\f", "ctl \u0001\u001f del \u007f", "sep \u2028\u2029 nbsp \u00a0", "html <b>&'</b>"],
    "key_order": {"b": 1, "a": {"z": True, "y": None, "Z": False}, "ä": [], "A": {}, "10": "x", "9": "y"},
    "numbers": [0, -7, 12345678901234, 1.0, -0.0, 0.5, 0.1, 1e-05, 0.0001, 2.5e-07, 1e16, 1234567890123456.0, 123456789.125, 1e300, -3.75],
    "tool": {"type": "function", "function": {"name": "get_weather", "description": "Wetter für eine Stadt",
                                              "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Köln", "東京"]}},
                                                             "required": ["city"]}}},
    "scalars": ["plain", 3, 2.0, True, None],
}

KWARGS = [
    "",
    "ensure_ascii=false",
    "ensure_ascii=true",
    "sort_keys=true",
    "indent=2",
    "indent=0",
    "indent=2, ensure_ascii=true",
    "separators=(',', ':')",
    "separators=(', ', ': '), indent=4",
    "ensure_ascii=true, sort_keys=true, separators=(',', ':')",
    "ensure_ascii=false, indent=2, sort_keys=true",
]


def py_kwargs(src):
    # The same keyword arguments as Python values (Jinja's true/false are Python's True/False).
    return eval(f"dict({src})", {"true": True, "false": False})


def main():
    cases = []
    for name, value in VALUES.items():
        for kw in KWARGS:
            template = "{{ value | tojson(" + kw + ") }}"
            rendered = render_jinja_template(conversations=[[{"role": "user", "content": ""}]], chat_template=template, value=value)[0][0]
            direct = json.dumps(value, **{"ensure_ascii": False, **py_kwargs(kw)})
            assert rendered == direct, (name, kw, rendered, direct)
            cases.append({"value_name": name, "template": template, "value": value, "expected": rendered})
    out = {"transformers": transformers.__version__, "cases": cases}
    with open(os.path.join(HERE, "tojson_expected.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
    print(len(cases), "tojson cases")


if __name__ == "__main__":
    main()
