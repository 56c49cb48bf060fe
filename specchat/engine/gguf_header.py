"""A GGUF file's header, read without its tensors and without torch: the start-up checks refuse a file that is not
GGUF or was cut short in one line, before a loader fails deep inside on it; the lean runner reads the file's
weights in place from what it lists (engine/gguf_model.py)."""

from __future__ import annotations

import functools
import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class TensorInfo:
    type: int  # ggml's type id (gguf.GGMLQuantizationType)
    shape: tuple[int, ...]  # innermost first, as GGUF lists it: a matrix [N, D] is (D, N)
    offset: int  # where its data starts in the file


@dataclass(frozen=True)
class Header:
    file_type: str | None  # general.file_type as llama.cpp names it (Q4_K_M, F16, F32)
    needed: int | None  # the bytes the tensors reach to (None: a tensor type this gguf package does not know)
    size: int  # the file's
    metadata: dict = field(default_factory=dict)  # key -> value, for the numbers and strings (arrays left out)
    tensors: dict = field(default_factory=dict)  # name -> TensorInfo


def read(path: Path) -> Header:
    """One walk over the metadata and tensor infos that reads only lengths (gguf's GGUFReader turns the whole
    vocabulary into arrays: seconds for 150k tokens). ValueError, in words for the user, for what is not GGUF.
    Kept while the file's inode, size and modification time stay: a start asks for each file's header in six places
    (the checks, the engine's choice, the loaders), 40-60 ms each on a 150k vocabulary. Shared: not to be changed."""
    stat = Path(path).stat()
    return _read(Path(path), stat.st_size, (stat.st_ino, stat.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _read(path: Path, size: int, _version: tuple[int, int]) -> Header:
    import gguf

    kinds = gguf.GGUFValueType
    formats = {kinds.UINT8: "B", kinds.INT8: "b", kinds.BOOL: "?", kinds.UINT16: "H", kinds.INT16: "h", kinds.UINT32: "I",
               kinds.INT32: "i", kinds.FLOAT32: "f", kinds.UINT64: "Q", kinds.INT64: "q", kinds.FLOAT64: "d"}
    sizes = {kind: struct.calcsize(fmt) for kind, fmt in formats.items()}
    metadata, tensors = {}, {}
    with open(path, "rb") as f:
        first = f.read(4)
        if first != b"GGUF":
            raise ValueError(f"{path} is not a GGUF model file (its first bytes are {first!r}, not b'GGUF')")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            at = 4

            def take(fmt: str) -> tuple:
                nonlocal at
                values = struct.unpack_from(order + fmt, data, at)
                at += struct.calcsize(order + fmt)
                return values

            def one(fmt: str = "Q") -> int:
                return take(fmt)[0]

            def skip(kind: int) -> None:
                nonlocal at
                if kind == kinds.STRING:
                    length = one()
                    at += length
                elif kind == kinds.ARRAY:
                    item, count = take("IQ")
                    if count > size - at:  # more items than bytes left
                        raise struct.error
                    if item in sizes:
                        at += sizes[item] * count
                    elif item == kinds.STRING:  # a vocabulary: 150k strings, one length each
                        length = struct.Struct(order + "Q").unpack_from
                        for _ in range(count):
                            at += 8 + length(data, at)[0]
                    else:
                        for _ in range(count):
                            skip(item)
                else:
                    at += sizes[kind]

            try:
                order = "<" if struct.unpack_from("<I", data, 4)[0] < 1 << 16 else ">"  # the version tells the byte order
                _version, n_tensors, n_kv = take("IQQ")
                file_type, alignment = None, 32
                for _ in range(n_kv):
                    length = one()
                    key, at = data[at:at + length], at + length
                    kind = one("I")
                    if key == b"general.file_type":
                        value = one("I")
                        name = next((t.name for t in gguf.LlamaFileType if t == value), None)  # None: newer than gguf
                        file_type = "F32" if name == "ALL_F32" else name and name.removeprefix("MOSTLY_")
                    elif key == b"general.alignment":
                        alignment = one("I") or 32
                    elif kind in formats:
                        metadata[key.decode()] = one(formats[kind])
                    elif kind == kinds.STRING:
                        length = one()
                        metadata[key.decode()], at = data[at:at + length].decode("utf-8", "replace"), at + length
                    else:
                        skip(kind)
                end, known = 0, True
                for _ in range(n_tensors):
                    length = one()  # the name's
                    name, at = data[at:at + length].decode("utf-8", "replace"), at + length
                    shape = take(f"{one('I')}Q")
                    kind, offset = take("IQ")
                    tensors[name] = (kind, shape, offset)
                    block, nbytes = gguf.GGML_QUANT_SIZES.get(kind, (0, 0))
                    known = known and block > 0
                    end = max(end, offset + math.prod(shape) // max(block, 1) * nbytes)
                if at > size:
                    raise struct.error
            except (struct.error, KeyError, ValueError):
                raise ValueError(f"{path} is truncated or damaged: its header breaks off or holds values no GGUF "
                                 f"reader knows ({size:,} bytes)") from None
    data_start = -(-at // alignment) * alignment  # the header, padded to the alignment
    tensors = {name: TensorInfo(kind, shape, data_start + offset) for name, (kind, shape, offset) in tensors.items()}
    return Header(file_type, (data_start + end if n_tensors else at) if known else None, size, metadata, tensors)


def problem(path: Path) -> str | None:
    """Why `path` cannot be loaded as a GGUF model, in one line, or None."""
    try:
        header = read(path)
    except ValueError as e:
        return str(e)
    except OSError as e:
        return f"cannot read {path}: {e.strerror or e}"
    if header.needed is not None and header.size < header.needed:
        return (f"{path} is truncated or damaged: its tensors need {header.needed:,} bytes, the file has "
                f"{header.size:,} (copy or download it again)")
    return None
