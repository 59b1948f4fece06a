"""tensorfile.py: minimal safetensors I/O with plain reads and writes (no mmap), so that memory
stays bounded and checkable: a file's header, rows of a stored tensor, a tensor read a chunk of
rows at a time, and a writer for a file whose tensor list is known in advance.

    python quantize.py --model DIR     # reads and writes every tensor through these

Leaves out: dtypes beyond DTYPES, tensors stored in any other order than their header's.
"""
import json
import math
import struct
from pathlib import Path

import torch


class TensorFileError(ValueError):
    """A corrupt, truncated or unsupported safetensors file (the message says which and what to
    do)."""


DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "U8": torch.uint8,
          "F8_E4M3": torch.float8_e4m3fn, "I64": torch.int64, "I32": torch.int32,
          "BOOL": torch.bool}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def read_header(path: Path) -> tuple[dict, int]:
    """-> ({name: {dtype, shape, data_offsets}}, data start offset). Raises TensorFileError on a
    corrupt file."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            if n > size - 8:
                raise ValueError("header longer than file")
            header = json.loads(f.read(n))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise TensorFileError(f"{path} is not a valid safetensors file ({e}): "
                            "re-download or re-save it")
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end > size:
        raise TensorFileError(f"{path} is truncated ({size} bytes, header needs {8 + n + end}): "
                            "re-download it")
    for k, v in header.items():
        if v["dtype"] not in DTYPES:
            raise TensorFileError(f"{path}: tensor {k} has unsupported dtype {v['dtype']}")
    return header, 8 + n


def read_rows(path: Path, meta: dict, data_start: int, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) of a stored tensor (dim 0), read with one seek + read."""
    dtype, shape = DTYPES[meta["dtype"]], meta["shape"]
    row_elems = math.prod(shape[1:])
    isz = torch.tensor([], dtype=dtype).element_size()
    buf = torch.empty((r1 - r0) * row_elems * isz, dtype=torch.uint8)
    with open(path, "rb") as f:
        f.seek(data_start + meta["data_offsets"][0] + r0 * row_elems * isz)
        f.readinto(buf.numpy())
    return buf.view(dtype).reshape([r1 - r0] + list(shape[1:]))


class ShardWriter:
    """Writes one safetensors file whose tensor list is known in advance, tensor data arriving
    row chunk by row chunk."""

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, list[int]]]):
        header, off = {}, 0
        for name, dtype, shape in specs:
            nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [off, off + nbytes]}
            off += nbytes
        header["__metadata__"] = {"format": "pt"}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.header, self.start = header, 8 + len(blob)
        self.f = open(path, "wb")
        self.f.write(struct.pack("<Q", len(blob)) + blob)
        self.f.truncate(self.start + off)

    def write_rows(self, name: str, row0: int, t: torch.Tensor):
        row_bytes = t[0].numel() * t.element_size() if t.shape[0] else 0
        self.f.seek(self.start + self.header[name]["data_offsets"][0] + row0 * row_bytes)
        self.f.write(t.contiguous().view(torch.uint8).numpy().tobytes())

    def close(self):
        self.f.close()


def rows_per_chunk(shape: list[int], chunk_mb: float) -> int:
    return max(1, int(chunk_mb * 2**20 / 4 / max(1, math.prod(shape[1:]))))


def iter_chunks(src, chunk_mb, device):
    """Yield (row0, rows as fp32-capable tensor on device) for one stored tensor."""
    f, meta, start = src
    shape = meta["shape"] or [1]
    step = rows_per_chunk(shape, chunk_mb)
    for r0 in range(0, shape[0], step):
        r1 = min(shape[0], r0 + step)
        yield r0, read_rows(f, {**meta, "shape": shape}, start, r0, r1).to(device)
