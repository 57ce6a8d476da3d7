"""The official `openai` SDK against `dflash serve`: chat (streaming and not), completions.

Usage: python3 openai_sdk.py http://127.0.0.1:PORT/v1   (API key sk-test, model id `tiny`)
"""
import sys

import openai
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1], api_key="sk-test")
msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat sat"}]

r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True})
text = r.choices[0].message.content
assert r.choices[0].finish_reason == "length", r
assert r.usage.completion_tokens == 12, r.usage
assert r.model_extra["dflash"]["mode"] == "dflash", r.model_extra

parts, usage, finish = [], None, None
for chunk in client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}):
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            parts.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
assert "".join(parts) == text, (parts, text)
assert finish == "length" and usage.completion_tokens == 12, (finish, usage)

c = client.completions.create(model="tiny", prompt="the rain", max_tokens=5, temperature=0)
assert c.usage.completion_tokens <= 5 and isinstance(c.choices[0].text, str), c
chunks = list(client.completions.create(model="tiny", prompt="the rain", max_tokens=5,
                                        temperature=0, stream=True))
assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.choices[0].text

assert [m.id for m in client.models.list()] == ["tiny"]

try:
    client.chat.completions.create(model="tiny", messages=msgs, top_p=0)
    raise SystemExit("top_p=0 should fail")
except openai.BadRequestError as e:
    assert e.body["param"] == "top_p", e.body

bad = OpenAI(base_url=sys.argv[1], api_key="wrong", max_retries=0)
try:
    bad.models.list()
    raise SystemExit("a wrong key should fail")
except openai.AuthenticationError:
    pass
print("OK")
