"""Split the HumanEval and MT-Bench prompt sets into the part evaluations use and the part a
draft may be trained on (issue 26: code and MT-Bench-style questions in the training data, the
evaluation prompts never trained on).

usage: python3 tools/train/eval_split.py [HELD] [REPEAT]

- data/eval/humaneval-held.jsonl.gz, data/eval/mtbench-held.jsonl.gz: the first HELD records
  (40) of data/eval/HumanEval.jsonl.gz and data/eval/mt_bench_question.jsonl.gz, the ones
  `dflash bench --prompts FILE --limit N` reads for N <= HELD; `dflash train --exclude-prompts`
  them, so no record an evaluation can read is trained on;
- data/train/humaneval-rest.jsonl.gz, data/train/mtbench-rest.jsonl.gz: the records after them,
  each written REPEAT times (16) with ids `ID#k`, so one T = 1 generation pass samples each
  prompt REPEAT times (the trainer seeds record i of pass p with p * 100000 + i).
"""
import gzip, json, sys

held = int(sys.argv[1]) if len(sys.argv) > 1 else 40
repeat = int(sys.argv[2]) if len(sys.argv) > 2 else 16
for src, name, key in [("data/eval/HumanEval.jsonl.gz", "humaneval", "task_id"),
                       ("data/eval/mt_bench_question.jsonl.gz", "mtbench", "question_id")]:
    recs = [json.loads(l) for l in gzip.open(src, "rt", encoding="utf-8") if l.strip()]
    assert len(recs) > held, f"{src}: {len(recs)} records, not more than {held}"
    # mtime 0: the same bytes on every run
    with gzip.GzipFile(f"data/eval/{name}-held.jsonl.gz", "wb", mtime=0) as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs[:held]).encode())
    rest = []
    for r in recs[held:]:
        for k in range(repeat):
            rest.append(dict(r, **{key: f"{r[key]}#{k}"}))
    with gzip.GzipFile(f"data/train/{name}-rest.jsonl.gz", "wb", mtime=0) as f:
        f.write("".join(json.dumps(r) + "\n" for r in rest).encode())
    print(f"{name}: {held} held for evaluation, {len(recs) - held} x {repeat} = {len(rest)} to train on")
