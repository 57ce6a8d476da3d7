#!/usr/bin/env python3
"""Time to first token of a PROMPT_TOKENS-id completion (max_tokens 1). ttft_probe.py PORT PROMPT_TOKENS"""
import json, sys, time, random, urllib.request
port = int(sys.argv[1]); n = int(sys.argv[2])
random.seed(2)
ids = [random.randrange(200, 40000) for _ in range(n)]
body = json.dumps({"prompt": ids, "max_tokens": 1, "temperature": 0}).encode()
r = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"})
t0 = time.time(); out = json.loads(urllib.request.urlopen(r, timeout=900).read()); t = time.time() - t0
print(f"{n} tokens: {t:.2f} s, text {out['choices'][0]['text']!r}")
