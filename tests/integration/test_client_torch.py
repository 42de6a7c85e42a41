"""The torch and TorchRL integrations of the client (skipped, saying why, when torch or
torchrl is not installed: `pip install torch==2.13.0 torchrl==0.14.1`)."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

from distorefs_it import set_config, write_entry

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")


def _entry(i: int) -> bytes:
    out = io.BytesIO()
    np.savez(out, obs=np.full((4, 3), i, dtype=np.float32), action=np.int64(i))
    return out.getvalue()


def test_iterable_dataset_of_sampled_batches_in_loader_workers(buf):
    from distorefs.client.torchdata import SampledBatches
    for i in range(40):
        write_entry(buf, f"t{i:02d}", _entry(i))
    loader = torch.utils.data.DataLoader(SampledBatches(buf, 8, steps=5), batch_size=None, num_workers=2)
    batches = list(loader)
    assert len(batches) == 10  # 5 per worker
    for b in batches:
        assert b["obs"].shape == (8, 4, 3) and b["obs"].dtype == torch.float32
        assert len(b["keys"]) == 8 and b["weights"].shape == (8,)
        for key, obs, action in zip(b["keys"], b["obs"], b["action"]):
            assert int(key[1:]) == int(action) and bool((obs == float(action)).all())


def test_torchrl_replay_buffer_keeps_its_data_in_a_distorefs_buffer(buf):
    pytest.importorskip("torchrl", reason="torchrl is not installed (pip install torchrl==0.14.1)")
    from tensordict import TensorDict
    from distorefs.client.torchrl_storage import replay_buffer
    set_config(buf, {"capacity": 1000})
    rb = replay_buffer(buf, max_size=50, batch_size=16)
    data = TensorDict({"obs": torch.arange(30 * 4, dtype=torch.float32).reshape(30, 4),
                       "action": torch.arange(30), "next": {"obs": -torch.ones(30, 4)}}, batch_size=[30])
    rb.extend(data)
    assert len(rb) == 30
    assert sorted(os.listdir(buf / "entries")) == [f"{i:012d}" for i in range(30)]  # in the buffer, as files
    sample, info = rb.sample(return_info=True)
    assert sample.batch_size == torch.Size([16]) and sample["next", "obs"].shape == (16, 4)
    for row, index in zip(sample, info["index"].tolist()):
        assert torch.equal(row["obs"], data["obs"][index]) and int(row["action"]) == index
    rb.extend(data[:25])  # wraps around: indices 30..49 then 0..4 are written
    assert len(rb) == 50
    assert int(rb.storage.get(2)["action"]) == 22 and int(rb.storage.get(45)["action"]) == 15
    with np.load(buf / "entries" / "000000000002") as z:  # another process reads the same row
        assert int(z["action"]) == 22
