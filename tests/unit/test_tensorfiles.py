"""tools/tensorfiles: safetensors headers and torch.save archives read by name, dtype and
shape, without running anything a pickle names (a hostile one is refused, not executed)."""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import zipfile

import pytest

from distorefs.tools.inspection import describe_content
from distorefs.tools.tensorfiles import CannotRead, read_torch


def safetensors_bytes(tensors: dict, metadata: dict | None = None) -> bytes:
    """A safetensors file written by hand: header length, JSON header, data."""
    header, data, off = {}, b"", 0
    sizes = {"F32": 4, "I64": 8, "BF16": 2, "U8": 1}
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        data += bytes(n)
        off += n
    if metadata is not None:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def test_safetensors_by_hand(tmp_path):
    p = tmp_path / "model.safetensors"
    p.write_bytes(safetensors_bytes({"embed.weight": ("BF16", [10, 4]), "step": ("I64", [])},
                                    {"format": "pt", "note": "hand-made"}))
    info = describe_content(p)
    assert info == {"format": "safetensors", "metadata": {"format": "pt", "note": "hand-made"},
                    "tensors": {"embed.weight": {"dtype": "BF16", "shape": [10, 4], "bytes": 80},
                                "step": {"dtype": "I64", "shape": [], "bytes": 8}}}
    # cut short: its offsets point past the end
    p.write_bytes(p.read_bytes()[:-10])
    assert "outside" in describe_content(p)["error"]


def test_torch_save_names_dtypes_shapes(tmp_path):
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    p = tmp_path / "ck.pt"
    torch.save({"model": model.state_dict(), "epoch": 7,
                "extra": [torch.zeros(5, dtype=torch.bfloat16), torch.nn.Parameter(torch.ones(2, 2))],
                "view": torch.arange(12).reshape(3, 4)[:, 1]}, p)
    info = describe_content(p)
    assert info["format"] == "torch"
    t = info["tensors"]
    assert t["model.0.weight"] == {"dtype": "float32", "shape": [2, 3]}
    assert t["model.1.num_batches_tracked"] == {"dtype": "int64", "shape": []}
    assert t["extra.0"] == {"dtype": "bfloat16", "shape": [5]}
    assert t["extra.1"] == {"dtype": "float32", "shape": [2, 2]}
    assert t["view"] == {"dtype": "int64", "shape": [3]}
    assert info["values"]["epoch"] == "7"


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {_Evil.marker}",))


def _hostile_archive(path, marker) -> None:
    """A torch.save-shaped zip whose data.pkl calls os.system when unpickled normally."""
    _Evil.marker = marker
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"w": _Evil()}, protocol=2))
        z.writestr("archive/version", "3\n")


def test_hostile_pickle_is_refused_not_run(tmp_path):
    marker = tmp_path / "ran"
    p = tmp_path / "evil.pt"
    _hostile_archive(p, marker)
    info = describe_content(p)
    assert info["format"] == "torch" and "cannot read" in info["error"] and "system" in info["error"]
    assert not marker.exists()
    with zipfile.ZipFile(p) as z:
        with pytest.raises(CannotRead):
            read_torch(z, "archive/data.pkl")
    # a global smuggled in as a storage type, and BUILD on a shared placeholder: refused too
    for payload in (b"\x80\x02cbuiltins\neval\nq\x00.",
                    b"\x80\x02ctorch\nFloatStorage\n}(X\x05\x00\x00\x00_callcos\nsystem\nub."):
        with zipfile.ZipFile(io.BytesIO(_zip_with(payload))) as z:
            with pytest.raises(CannotRead):
                read_torch(z, "archive/data.pkl")


def _zip_with(data_pkl: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("archive/data.pkl", data_pkl)
    return out.getvalue()
