"""What a safetensors file or a torch.save archive holds (tensor names, dtypes, shapes),
read without running anything the file says: `distorefs inspect` uses it.

- safetensors: an 8-byte little-endian header length, then a JSON header mapping each
  tensor name to its dtype, shape and data offsets (and `__metadata__`, strings).
- torch.save (the zip format, torch >= 1.6): `PREFIX/data.pkl` is a pickle whose tensors
  are calls of `torch._utils._rebuild_tensor_v2` on persistent storage ids. Unpickling it
  the ordinary way runs whatever callables it names, so it is read here by a restricted
  unpickler: `find_class` hands out only placeholders for the few globals a tensor
  archive needs (the rebuild functions, storage types, OrderedDict), and any other global
  (os.system, a model class, numpy) ends the read with `CannotRead` naming it. torch is
  never imported, and no callable from the file is ever looked up in a real module.
"""

from __future__ import annotations

import collections
import io
import json
import pickle
import struct
import zipfile
from typing import Any, BinaryIO

MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own limit on the JSON header
MAX_PICKLE_BYTES = 256 << 20  # data.pkl holds names and shapes, not tensor data


class CannotRead(ValueError):
    """The file looks like a tensor archive but cannot be read safely or is malformed."""


# ----- safetensors ---------------------------------------------------------------------------

def looks_like_safetensors(head: bytes, size: int) -> bool:
    """`head` (the file's first 9 bytes or more) starts a safetensors header."""
    if len(head) < 9:
        return False
    n = struct.unpack_from("<Q", head)[0]
    return 2 <= n <= min(MAX_SAFETENSORS_HEADER, size - 8) and head[8:9] == b"{"


def read_safetensors(f: BinaryIO, size: int) -> dict:
    """{"format": "safetensors", "tensors": {name: {dtype, shape, bytes}}, "metadata": {...}}."""
    f.seek(0)
    n = struct.unpack("<Q", f.read(8))[0]
    try:
        header = json.loads(f.read(n))
    except ValueError as exc:
        raise CannotRead(f"safetensors header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CannotRead("safetensors header is not a JSON object")
    data_bytes = size - 8 - n
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, t in header.items():
        try:
            begin, end = t["data_offsets"]
            shape = [int(d) for d in t["shape"]]
            dtype = str(t["dtype"])
        except (KeyError, TypeError, ValueError):
            raise CannotRead(f"safetensors tensor {name!r}: malformed entry {str(t)[:100]}") from None
        if not 0 <= begin <= end <= data_bytes:
            raise CannotRead(f"safetensors tensor {name!r}: data offsets {begin}..{end} outside the "
                             f"{data_bytes} data bytes (a truncated file?)")
        tensors[name] = {"dtype": dtype, "shape": shape, "bytes": end - begin}
    return {"format": "safetensors", "tensors": tensors, "metadata": metadata}


# ----- torch.save archives -------------------------------------------------------------------

def torch_pickle_name(z: zipfile.ZipFile) -> str | None:
    """The archive's `PREFIX/data.pkl` member, or None (not a torch.save archive)."""
    names = [n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
    return min(names, key=len) if names else None


# torch's legacy storage classes (what the pickle names) and the dtypes they hold
_STORAGE_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
    "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128", "UntypedStorage": "uint8",
}
_DTYPE_NAMES = {"float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
                "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"}


class TensorInfo:
    """What a tensor of the archive is: dtype, shape (no data)."""

    def __init__(self, dtype: str, shape: list[int]) -> None:
        self.dtype = dtype
        self.shape = shape

    def as_dict(self) -> dict:
        return {"dtype": self.dtype, "shape": self.shape}


class _Storage:
    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


class _Placeholder:
    """A global the archive may name, standing for itself: calling it never runs torch code."""

    def __init__(self, name: str, call=None) -> None:
        self.name = name
        self._call = call

    def __setstate__(self, state) -> None:  # BUILD on a shared placeholder: refused
        raise CannotRead(f"the pickle sets the state of {self.name}")

    def __call__(self, *args, **kwargs):
        if self._call is None:
            raise CannotRead(f"the pickle calls {self.name}, which is not read here")
        return self._call(*args, **kwargs)


def _rebuild_tensor(storage, offset, size, *rest) -> TensorInfo:
    if not isinstance(storage, _Storage):
        raise CannotRead("a tensor whose storage is not a storage")
    return TensorInfo(storage.dtype, [int(d) for d in size])


def _rebuild_parameter(data, *rest) -> TensorInfo:
    if not isinstance(data, TensorInfo):
        raise CannotRead("a parameter that is not a tensor")
    return data


def _rebuild_from_type(func, new_type, args, state) -> TensorInfo:
    return func(*args)  # a tensor subclass (Parameter): the tensor it wraps


_ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _Placeholder("torch._utils._rebuild_tensor_v2", _rebuild_tensor),
    ("torch._utils", "_rebuild_tensor"): _Placeholder("torch._utils._rebuild_tensor", _rebuild_tensor),
    ("torch._utils", "_rebuild_parameter"): _Placeholder("torch._utils._rebuild_parameter", _rebuild_parameter),
    ("torch._utils", "_rebuild_parameter_with_state"): _Placeholder("torch._utils._rebuild_parameter_with_state",
                                                                    _rebuild_parameter),
    ("torch._tensor", "_rebuild_from_type_v2"): _Placeholder("torch._tensor._rebuild_from_type_v2",
                                                             _rebuild_from_type),
    ("torch", "Tensor"): _Placeholder("torch.Tensor"),
    ("torch.nn.parameter", "Parameter"): _Placeholder("torch.nn.parameter.Parameter"),
    **{("torch", cls): _Placeholder(f"torch.{cls}") for cls in _STORAGE_DTYPES},
    **{("torch", dt): _Placeholder(f"torch.{dt}") for dt in _DTYPE_NAMES},
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Every global goes through `find_class` (GLOBAL, STACK_GLOBAL and the copyreg
    extension codes alike), so only the placeholders above can ever be called."""

    def find_class(self, module: str, name: str):
        found = _ALLOWED.get((module, name))
        if found is None:
            raise CannotRead(f"the pickle asks for {module}.{name}, which is not a tensor archive's: not read "
                             f"(nothing in it was run)")
        return found

    def persistent_load(self, pid):
        if (isinstance(pid, tuple) and len(pid) >= 2 and pid[0] == "storage"
                and isinstance(pid[1], _Placeholder) and pid[1].name.startswith("torch.")):
            cls = pid[1].name.removeprefix("torch.")
            return _Storage(_STORAGE_DTYPES.get(cls, cls))
        raise CannotRead(f"unexpected persistent id {str(pid)[:80]}")


def _flatten(obj, prefix: str, tensors: dict, other: dict, depth: int = 0) -> None:
    if isinstance(obj, TensorInfo):
        tensors[prefix or "."] = obj.as_dict()
    elif depth > 32:
        other[prefix] = "nested too deeply"
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), tensors, other, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}.{i}" if prefix else str(i), tensors, other, depth + 1)
    elif isinstance(obj, (int, float, str, bool, type(None))):
        text = repr(obj)
        other[prefix or "."] = text if len(text) <= 80 else text[:77] + "..."
    else:
        other[prefix or "."] = type(obj).__name__


def read_torch(z: zipfile.ZipFile, member: str) -> dict:
    """{"format": "torch", "tensors": {dotted name: {dtype, shape}}, "values": {name: repr}}:
    a torch.save archive's pickle read by the restricted unpickler (CannotRead if it names
    anything else than tensors and plain containers)."""
    info = z.getinfo(member)
    if info.file_size > MAX_PICKLE_BYTES:
        raise CannotRead(f"{member} is {info.file_size} bytes: not read")
    data = z.read(member)
    try:
        obj = _RestrictedUnpickler(io.BytesIO(data)).load()
    except CannotRead:
        raise
    except Exception as exc:  # a malformed pickle: any error of the reader is "cannot read"
        raise CannotRead(f"{member}: not a readable pickle ({type(exc).__name__}: {exc})") from None
    tensors: dict = {}
    values: dict = {}
    _flatten(obj, "", tensors, values)
    return {"format": "torch", "tensors": tensors, "values": values}


def tensor_rows(tensors: dict) -> list[list[str]]:
    """Table rows (name, dtype, shape) for `inspect`'s text output."""
    return [[name, t["dtype"], str(tuple(t["shape"]))] for name, t in tensors.items()]


__all__ = ["CannotRead", "looks_like_safetensors", "read_safetensors", "torch_pickle_name", "read_torch",
           "tensor_rows"]
