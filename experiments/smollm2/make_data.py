"""The SmolLM2 experiment's prompts (docs/experiments/smollm2.md): one- and two-digit sums asked in words.
Writes data.jsonl (480 rows: a in 1..40, b in 1..12) next to this file; deterministic."""
import json
from pathlib import Path

rows = [{"prompt": f"What is {a} + {b}? Reply with only the number.", "answer": str(a + b)}
        for a in range(1, 41) for b in range(1, 13)]
(Path(__file__).parent / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
print(f"wrote {len(rows)} rows")
