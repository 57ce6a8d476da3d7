"""Write a small training prompt file from the ShareGPT wheel's data (which is cut off
mid-record and 125 MB): the first N records with a human turn followed by a gpt turn, as
JSONL `{"id", "conversations": [human, gpt]}` lines, gzipped. `dflash train --prompts` reads
it (first human turn = prompt; first gpt turn = the reference for `--data relabel`).

usage: python3 tools/train/sharegpt_subset.py SHAREGPT_JSON OUT.jsonl.gz [N] [MAX_PROMPT_CHARS] [prompts|turns]

With `prompts` last, only `{"id", "prompt"}` lines (for `--data self`, which needs no reference):
data/train/sharegpt-prompts-9k.jsonl.gz is `... 100000 2000 prompts` (every record of the
wheel's prefix that passes the filter: 9,669).

With `turns` last, the later human turns instead, each with the conversation before it:
`{"id": "ID_K", "messages": [{"role": "user"|"assistant", "content"}...]}` ending on human turn
K (K >= 2, the conversation's original human and gpt turns before it, strictly alternating),
where the whole chat is at most MAX_PROMPT_CHARS: more distinct prompts for `--data self`, and
the multi-turn chats a server sees. data/train/sharegpt-turns-2k4.jsonl.gz is
`... 100000 2400 turns`.
"""
import gzip, json, sys

src, out = sys.argv[1], sys.argv[2]
n = int(sys.argv[3]) if len(sys.argv) > 3 else 3000
max_chars = int(sys.argv[4]) if len(sys.argv) > 4 else 2000
mode = sys.argv[5] if len(sys.argv) > 5 else "conversations"
assert mode in ("prompts", "turns", "conversations"), f"unknown mode {mode}"
prompts_only = mode == "prompts"
role = {"human": "user", "gpt": "assistant"}
dec = json.JSONDecoder()
text = open(src, encoding="utf-8").read()
i = text.index("[") + 1
kept = 0
with gzip.open(out, "wt", encoding="utf-8") as f:
    while kept < n:
        while i < len(text) and text[i] in " \n\r\t,":
            i += 1
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the truncated tail
        conv = rec.get("conversations") or []
        if mode == "turns":
            # human turn k (k >= 2) after a strictly alternating human / gpt history
            chat, size = [], 0
            for k, t in enumerate(conv):
                want = "human" if k % 2 == 0 else "gpt"
                value = t.get("value", "")
                if t.get("from") != want or not value.strip():
                    break
                chat.append({"role": role[want], "content": value})
                size += len(value)
                if size > max_chars:
                    break
                if want == "human" and k >= 2 and kept < n:
                    f.write(json.dumps({"id": f"{rec.get('id')}_{k // 2}", "messages": chat}) + "\n")
                    kept += 1
            continue
        if len(conv) < 2 or conv[0].get("from") != "human" or conv[1].get("from") != "gpt":
            continue
        q, a = conv[0].get("value", ""), conv[1].get("value", "")
        if not q.strip() or not a.strip() or len(q) > max_chars:
            continue
        if prompts_only:
            f.write(json.dumps({"id": rec.get("id"), "prompt": q}) + "\n")
        else:
            f.write(json.dumps({"id": rec.get("id"), "conversations": conv[:2]}) + "\n")
        kept += 1
print(f"{kept} records -> {out}")
