import os
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Built-in models are cached here for the test session (and reused between runs).
os.environ.setdefault("UNISON_HOME", str(ROOT / ".unison-test-home"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
SHARED = Path(os.environ.get("UNISON_SHARED", ROOT.parent / "shared"))


@pytest.fixture(scope="session")
def tiny_dir():
    from unison.models import builtin_model_dir

    return builtin_model_dir("tiny")


@pytest.fixture(scope="session")
def shared_data():
    path = SHARED / "data" / "math"
    if not path.exists():
        pytest.skip("../shared/data/math is not present next to the repository")
    return path


@pytest.fixture()
def module_dir(tmp_path, monkeypatch):
    """A directory on sys.path holding rewards.py: ``always`` (raises), ``zero``, ``length``."""
    (tmp_path / "rewards.py").write_text(textwrap.dedent("""
        def always(response, item):
            raise ValueError("no answer field")

        def zero(response, item):
            return 0.0

        def length(response, item):
            return len(response) / 10
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.fixture()
def char_reward(tmp_path):
    """``--set`` overrides for a reward of len(response) / 10, graded even when cut: real gradients on a random
    model."""
    p = tmp_path / "char_reward.py"
    p.write_text("def reward(response, item):\n    return len(response) / 10\n")
    return [f"task.reward={p}:reward", "task.truncated_reward=null"]


@pytest.fixture(autouse=True)
def _gemm_choice_per_test():
    """A test that makes this process's fp32 matmuls oneDNN's (unison/gemm.py) does not change the bits of
    the tests after it."""
    from unison import gemm

    before = gemm.current()
    yield
    gemm.use(before)
