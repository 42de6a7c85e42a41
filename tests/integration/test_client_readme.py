"""The README's section on the Python client runs as written, against a real mount (its
paths under /mnt/rl pointed at the test's mount; the names it leaves to the reader given)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from distorefs_it import write_entry

README = Path(__file__).resolve().parents[2] / "README.md"


def _snippets() -> list[str]:
    text = README.read_text()
    section = text[text.index("## The Python client beside the mount"):]
    section = section[:section.index("\n## ", 3)]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    return ["\n".join(line[2:] if line.startswith("  ") else line for line in b.splitlines()) for b in blocks]


def test_readme_client_snippets_run(fs):
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")
    pytest.importorskip("torchrl", reason="torchrl is not installed (pip install torchrl==0.14.1)")
    from tensordict import TensorDict
    snippets = _snippets()
    assert len(snippets) >= 4
    replay = fs.buffer("replay")
    (fs.mnt / "buffers" / "transitions").mkdir()
    import io
    for i in range(300):
        out = io.BytesIO()
        np.savez(out, obs=np.full(4, i, np.float32), action=np.int64(i % 3), reward=np.float32(1))
        write_entry(replay, f"r{i}", out.getvalue())
    scope = {"np": np, "torch": torch, "td_errors": np.ones(256),
             "obs": np.zeros(4, np.float32), "a": 1, "r": 0.5,
             "t2": {"obs": np.ones(4, np.float32), "action": np.int64(2), "reward": np.float32(0)},
             "t3": {"obs": np.ones(4, np.float32), "action": np.int64(0), "reward": np.float32(1)},
             "transitions": TensorDict({"obs": torch.zeros(512, 4), "action": torch.arange(512)}, [512])}
    for code in snippets:
        if "MountedDataset" in code and "imagenet" in code:
            continue  # the datasets section's own example
        code = code.replace("/mnt/rl", str(fs.mnt))
        exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
    assert scope["batch"] is not None
