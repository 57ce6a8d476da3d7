#!/usr/bin/env python3
"""Send a PROMPT_TOKENS-id completion to a local dflash server, leave after LEAVE seconds, then
time a 1-token request: how soon the engine is free. cancel_probe.py PORT PROMPT_TOKENS LEAVE"""
import json, socket, sys, time, random, urllib.request
port = int(sys.argv[1]); n = int(sys.argv[2]); leave = float(sys.argv[3])
random.seed(1)
ids = [random.randrange(200, 40000) for _ in range(n)]
body = json.dumps({"prompt": ids, "max_tokens": 4, "temperature": 0}).encode()
req = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
s = socket.create_connection(("127.0.0.1", port)); s.sendall(req)
t0 = time.time(); time.sleep(leave); s.close(); t_left = time.time()
small = json.dumps({"prompt": "Hi", "max_tokens": 1, "temperature": 0}).encode()
r = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=small, headers={"Content-Type": "application/json"})
urllib.request.urlopen(r, timeout=600).read()
t_done = time.time()
print(f"prompt {n} tokens, left after {t_left - t0:.2f} s; the next request answered {t_done - t_left:.2f} s after the client left")
