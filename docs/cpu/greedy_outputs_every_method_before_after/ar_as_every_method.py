"""outputs.jsonl -> the same file with each method's records replaced by ar's (same
batch_size, repeat, request_id), so compare_outputs --reference=<this> --other=<run>
compares every method against ar of its own run."""
import json
import sys

recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ar = {(r["batch_size"], r["repeat"], r["request_id"]): r for r in recs if r["method"] == "ar"}
with open(sys.argv[2], "w") as f:
  for r in recs:
    f.write(json.dumps({**ar[(r["batch_size"], r["repeat"], r["request_id"])], "method": r["method"]}) + "\n")
