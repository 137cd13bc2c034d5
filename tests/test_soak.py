"""The soak of "nothing lost" (scripts/soak.py, issue 51 item 11), shortened: a K = 2 run SIGKILLed three times
(its whole process group) and resumed, against the same run left alone. The full soak — 500 steps, 10 kills — and its
figures: docs/testing.md."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_run_killed_three_times_equals_the_run_left_alone(tmp_path):
    out = tmp_path / "soak"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--steps", "60", "--kills", "3",
                        "--every", "10", "--out", str(out)], capture_output=True, text=True, timeout=1200)
    result = json.loads((out / "soak.json").read_text())
    assert r.returncode == 0, (result["checks"], r.stdout[-2000:], r.stderr[-2000:])
    assert len(result["kills"]) == 3 and all(k["returncode"] == -9 for k in result["kills"])
    assert result["checkpoints_kept"] == ["step_000050", "step_000060"] and not result["extra_files"]


def test_the_soak_kills_as_many_times_as_asked():
    """Two draws that snap to the same checkpoint step are drawn again (the first 500-step soak got 9 of 10 kills);
    every other target sits on a checkpoint step (every 25), all within [3, steps − 3]."""
    import random

    sys.path.insert(0, str(ROOT / "scripts"))
    from soak import kill_targets

    for seed in range(20):
        t = kill_targets(random.Random(seed), 500, 10, 25)
        assert len(t) == len(set(t)) == 10 and all(3 <= x <= 497 for x in t)
        assert sum(x % 25 == 0 for x in t) >= 5
    assert kill_targets(random.Random(0), 12, 10, 25) == [3, 4, 5, 6, 7, 8, 9]  # fewer steps than kills: all of them
