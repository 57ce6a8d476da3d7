#!/usr/bin/env python3
"""Renders published chat templates with transformers' own Jinja setup, for the Rust template
tests: crates/dflash/tests/fixtures/templates/<name>.chat_template.jinja ->
<name>.renders.json ([{messages, tools, add_generation_prompt, extra, rendered}]).

The date written by `strftime_now` is replaced by `<DATE>` on both sides.
Usage: /work/pyenv/bin/python tools/goldens/make_template_goldens.py
"""

from __future__ import annotations

import json
import os
import re

from transformers.utils.chat_template_utils import render_jinja_template

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "..", "..", "crates", "dflash", "tests", "fixtures", "templates")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Unit", "default": "celsius"},
        "days": {"type": "array", "items": {"type": "integer"}, "description": "Days ahead"}},
        "required": ["city"]}}}

CASES = {
    # gpt-oss (harmony): system message built by macros, developer message, tools rendered as a
    # TypeScript namespace, assistant history on the final channel, generation prompt
    "gpt-oss-20b": [
        dict(messages=[{"role": "user", "content": "Hi"}], tools=None, add_generation_prompt=True, extra={}),
        dict(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                       {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
             tools=None, add_generation_prompt=True, extra={"reasoning_effort": "high"}),
        dict(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
             add_generation_prompt=True, extra={"model_identity": "You are a test model."}),
        dict(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
             tools=None, add_generation_prompt=False, extra={}),
    ],
}


def undate(s: str) -> str:
    return re.sub(r"Current date: \d{4}-\d{2}-\d{2}", "Current date: <DATE>", s)


def main() -> None:
    for name, cases in CASES.items():
        with open(os.path.join(FIX, f"{name}.chat_template.jinja")) as f:
            src = f.read()
        out = []
        for c in cases:
            rendered = render_jinja_template(conversations=[c["messages"]], tools=c["tools"], chat_template=src,
                                             add_generation_prompt=c["add_generation_prompt"], **c["extra"])
            rendered = rendered[0][0] if isinstance(rendered, tuple) else rendered[0]
            out.append(dict(c, rendered=undate(rendered)))
        with open(os.path.join(FIX, f"{name}.renders.json"), "w") as f:
            json.dump(out, f, indent=1, ensure_ascii=False)
            f.write("\n")
        print(name, len(out), "renders")


if __name__ == "__main__":
    main()
