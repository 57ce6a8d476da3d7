"""The official `openai` SDK runs a tool loop against `dflash serve` on the scripted tool
model of serve.rs (`tool_model`): a call (with its reasoning), the tool's answer, the reply.

Usage: python3 openai_tools.py http://127.0.0.1:PORT/v1   (model id `tiny`)
"""
import json
import sys

from openai import OpenAI

client = OpenAI(base_url=sys.argv[1], api_key="unused")
tools = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
messages = [{"role": "user", "content": "What is the weather in Paris?"}]


def get_weather(city):
    return {"city": city, "temp_c": 18, "sky": "sunny"}


r = client.chat.completions.create(model="tiny", messages=messages, tools=tools,
                                   temperature=0, max_tokens=40)
choice = r.choices[0]
assert choice.finish_reason == "tool_calls", r
msg = choice.message
assert msg.content is None, msg
assert msg.model_extra["reasoning_content"] == "I will look up the weather.", msg.model_extra
(call,) = msg.tool_calls
assert call.type == "function" and call.function.name == "get_weather", call
assert json.loads(call.function.arguments) == {"city": "Paris"}, call

# streamed: the SDK's accumulation of delta.tool_calls gives the same call
names, args, ids, reasoning, finish = {}, {}, {}, [], None
for chunk in client.chat.completions.create(model="tiny", messages=messages, tools=tools,
                                            temperature=0, max_tokens=40, stream=True):
    if not chunk.choices:
        continue
    d = chunk.choices[0].delta
    assert not (d.content or "").strip(), d
    if (d.model_extra or {}).get("reasoning_content"):
        reasoning.append(d.model_extra["reasoning_content"])
    for tc in d.tool_calls or []:
        if tc.id:
            ids[tc.index] = tc.id
        if tc.function and tc.function.name:
            names[tc.index] = tc.function.name
        if tc.function and tc.function.arguments:
            args[tc.index] = args.get(tc.index, "") + tc.function.arguments
    finish = chunk.choices[0].finish_reason or finish
assert finish == "tool_calls", finish
assert names == {0: "get_weather"} and json.loads(args[0]) == {"city": "Paris"}, (names, args)
assert "".join(reasoning) == "I will look up the weather.", reasoning

# the loop: run the tool, send its answer, get the reply
messages.append(msg.model_dump(exclude_none=True))
for tc in msg.tool_calls:
    result = get_weather(**json.loads(tc.function.arguments))
    messages.append({"role": "tool", "tool_call_id": tc.id, "content": json.dumps(result)})
# (the scripted model answers when its <think> token, id 5, is banned)
r2 = client.chat.completions.create(model="tiny", messages=messages, tools=tools,
                                    temperature=0, max_tokens=40, logit_bias={"5": -100})
assert r2.choices[0].finish_reason == "stop", r2
assert r2.choices[0].message.content == "It is 18 C and sunny in Paris.", r2
assert not r2.choices[0].message.tool_calls, r2
assert r2.usage.prompt_tokens > r.usage.prompt_tokens, (r.usage, r2.usage)
print("OK")
