#!/usr/bin/env python3
"""Concurrent vs one-after-another requests against a running `dflash serve` (issue 23).

Sends N chat completions (temperature 0) one after another, then the same N at once (one
thread each), alternating the order over repeats; prints the wall times, their ratio, and
whether every request's text was the same both ways. Standard library only.

  python3 tools/serve/concurrency.py --url http://127.0.0.1:8123 --n 4 --max-tokens 64 --repeat 3
"""
import argparse
import json
import statistics
import threading
import time
import urllib.request

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain why the sky is blue in two sentences.",
    "List five prime numbers and say what makes them prime.",
    "What is the capital of France? Answer and then describe it briefly.",
    "Write a haiku about autumn leaves.",
    "How do I reverse a list in Python?",
    "Summarize the plot of Romeo and Juliet.",
    "What are the three states of matter?",
]


def ask(url, prompt, max_tokens):
    body = json.dumps({"messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        v = json.loads(r.read())
    return v["choices"][0]["message"]["content"], v["usage"]["completion_tokens"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8123")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(a.n)]
    ask(a.url, "warm up", 8)

    def one_by_one():
        t = time.perf_counter()
        out = [ask(a.url, p, a.max_tokens) for p in prompts]
        return time.perf_counter() - t, out

    def together():
        out = [None] * len(prompts)

        def run(i):
            out[i] = ask(a.url, prompts[i], a.max_tokens)

        ts = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        t = time.perf_counter()
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        return time.perf_counter() - t, out

    seq, con, same = [], [], True
    for rep in range(a.repeat):
        if rep % 2 == 0:
            s, o1 = one_by_one()
            c, o2 = together()
        else:
            c, o2 = together()
            s, o1 = one_by_one()
        seq.append(s)
        con.append(c)
        same &= o1 == o2
    s, c = statistics.median(seq), statistics.median(con)
    tokens = sum(t for _, t in o1)
    print(f"{a.n} requests x {a.max_tokens} tokens ({tokens} generated): one after another {s:.2f} s, "
          f"concurrent {c:.2f} s, ratio {c / s:.2f}; same texts: {same}")


if __name__ == "__main__":
    main()
