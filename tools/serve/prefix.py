#!/usr/bin/env python3
"""Prefix cache on a running `dflash serve` (issue 23): a chat whose first turn carries a long
system prompt (~2,000 tokens), then a second turn (first turn + its answer + a new question).
Prints both turns' TTFT (the server's `dflash.ttft_ms`) and prompt tokens restored from the
cache; with --cold URL (a server started with --prefix-cache-mb 0) also checks that turn 2's
text equals a cold run's. Standard library only.

  python3 tools/serve/prefix.py --url http://127.0.0.1:8123 --cold http://127.0.0.1:8124
"""
import argparse
import json
import urllib.request

SYSTEM = ("You are a careful assistant for a small software team. " +
          "The team writes Rust and Python services, reviews every change, keeps tests green, "
          "and documents what it measures. ") * 60


def chat(url, messages, max_tokens):
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8123")
    ap.add_argument("--cold", default=None)
    ap.add_argument("--max-tokens", type=int, default=48)
    a = ap.parse_args()
    m1 = [{"role": "system", "content": SYSTEM},
          {"role": "user", "content": "Name three things a code review should check."}]
    t1 = chat(a.url, m1, a.max_tokens)
    ans = t1["choices"][0]["message"]["content"]
    m2 = m1 + [{"role": "assistant", "content": ans},
               {"role": "user", "content": "Which of them matters most, and why?"}]
    t2 = chat(a.url, m2, a.max_tokens)
    d1, d2 = t1["dflash"], t2["dflash"]
    print(f"turn 1: {t1['usage']['prompt_tokens']} prompt tokens, TTFT {d1['ttft_ms']:.1f} ms, "
          f"cached {d1.get('cached_prompt_tokens', 0)}")
    print(f"turn 2: {t2['usage']['prompt_tokens']} prompt tokens, TTFT {d2['ttft_ms']:.1f} ms, "
          f"cached {d2.get('cached_prompt_tokens', 0)}; TTFT ratio {d2['ttft_ms'] / d1['ttft_ms']:.3f}")
    if a.cold:
        c2 = chat(a.cold, m2, a.max_tokens)
        same = c2["choices"][0]["message"]["content"] == t2["choices"][0]["message"]["content"]
        print(f"turn 2 cold: TTFT {c2['dflash']['ttft_ms']:.1f} ms; same text as the cached run: {same}")
        if not same:
            w, c = t2["choices"][0]["message"]["content"], c2["choices"][0]["message"]["content"]
            k = next((i for i, (x, y) in enumerate(zip(w, c)) if x != y), min(len(w), len(c)))
            print(f"  first difference at character {k}: cached {w[max(0, k - 40):k + 40]!r}")
            print(f"  {'':>31}cold   {c[max(0, k - 40):k + 40]!r}")


if __name__ == "__main__":
    main()
