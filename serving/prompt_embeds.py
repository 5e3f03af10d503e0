"""vLLM's `prompt_embeds` over HTTP: a base64 string of `torch.save(tensor)`, read without torch.

torch is not a dependency of the server, and unpickling an untrusted file would run whatever
it names, so the archive is read here with an unpickler that knows four globals (the tensor
rebuild function, the float storage types, OrderedDict for the empty hook dict) and refuses
everything else. What comes out is a NumPy array (bfloat16 through ml_dtypes, which JAX
installs); anything else in the archive is a 400 naming the field.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import zipfile
from collections import OrderedDict

import ml_dtypes
import numpy as np

from serving.errors import APIError

_STORAGES = {"FloatStorage": np.dtype("<f4"), "HalfStorage": np.dtype("<f2"),
             "DoubleStorage": np.dtype("<f8"), "BFloat16Storage": np.dtype(ml_dtypes.bfloat16)}


class _Storage:
    def __init__(self, name: str):
        self.dtype = _STORAGES[name]


def _rebuild_tensor(storage, offset, size, stride, requires_grad=False, hooks=None,
                    metadata=None):
    """torch._utils._rebuild_tensor_v2, as a NumPy copy of the view it describes."""
    if len(size) != len(stride):
        raise ValueError("size and stride differ in length")
    item = storage.dtype.itemsize
    need = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1 if all(size) else 0
    if offset < 0 or need > len(storage) or any(s < 0 for s in stride):
        raise ValueError("the tensor's view lies outside its storage")
    return np.lib.stride_tricks.as_strided(storage[offset:], shape=tuple(size),
                                           strides=tuple(s * item for s in stride)).copy()


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str):
        super().__init__(io.BytesIO(data))
        self.archive, self.prefix = archive, prefix

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if module == "torch" and name in _STORAGES:
            return _Storage(name)
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a tensor")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _Storage)):
            raise pickle.UnpicklingError("not a tensor storage")
        raw = self.archive.read(f"{self.prefix}/data/{pid[2]}")
        return np.frombuffer(raw, pid[1].dtype)


def decode_prompt_embeds(value: str, field: str = "prompt_embeds") -> np.ndarray:
    """One base64 `torch.save` tensor -> a NumPy array (400 naming `field` otherwise)."""
    try:
        raw = base64.b64decode(value, validate=True)
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            pkl = [n for n in archive.namelist() if n.endswith("/data.pkl")]
            if len(pkl) != 1:
                raise ValueError("not a torch.save archive")
            prefix = pkl[0][:-len("/data.pkl")]
            out = _Unpickler(archive.read(pkl[0]), archive, prefix).load()
    except (binascii.Error, zipfile.BadZipFile, pickle.UnpicklingError, ValueError, KeyError,
            EOFError, TypeError) as e:
        raise APIError(f"{field} must be a base64-encoded torch.save() of one float tensor: "
                       f"{e}", param=field) from None
    if not isinstance(out, np.ndarray):
        raise APIError(f"{field} must hold one tensor, not a {type(out).__name__}",
                       param=field)
    return out
