"""TFRecord files and `tf.train.Example` messages without TensorFlow or protobuf.

TFRecord framing, per record::

    uint64 length (little endian) | uint32 masked_crc32c(length bytes) | payload | uint32 masked_crc32c(payload)

masked_crc(x) = ((crc >> 15) | (crc << 17)) + 0xa282ead8 (mod 2**32), crc = CRC-32C (Castagnoli).

Damaged input is never silently lost: every CRC mismatch, truncated tail or undecodable payload becomes a
:class:`RecordIssue` (file, byte offset, kind, message) in the caller's list, the record is skipped, and reading
goes on with the next record. A payload CRC mismatch keeps the (CRC-checked) length, so the next record is found
exactly; a length CRC mismatch means the length cannot be trusted, so the reader scans forward for the next
offset whose 12-byte header checks out (``resync``).

`tf.train.Example` wire format (proto3), decoded/encoded by hand::

    Example   { Features features = 1; }
    Features  { map<string, Feature> feature = 1; }   // map entry: key = 1, value = 2
    Feature   { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3; } }
    BytesList { repeated bytes value = 1; }
    FloatList { repeated float value = 1 [packed = true]; }
    Int64List { repeated int64 value = 1 [packed = true]; }

Both packed and unpacked repeated scalars are accepted on decode (a proto2 writer may emit either).
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO, Iterable, Iterator, Mapping, Union

import numpy as np

# ---------------------------------------------------------------------------------------------------------------
# CRC-32C
# ---------------------------------------------------------------------------------------------------------------

_CRC32C_POLY_REVERSED = 0x82F63B78


def _make_table() -> list[int]:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ _CRC32C_POLY_REVERSED if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _make_table()


def crc32c_python(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """Table-driven CRC-32C (slow: ~1-3 MB/s; used only when no compiled implementation is installed)."""
    table = _TABLE
    crc ^= 0xFFFFFFFF
    for byte in bytes(data):
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _compiled_crc32c():
    try:  # PyPI "crc32c" (hardware accelerated)
        import crc32c as _mod  # type: ignore

        return "crc32c", lambda data: _mod.crc32c(data)
    except ImportError:
        pass
    try:  # PyPI "google-crc32c"
        import google_crc32c as _gmod  # type: ignore

        return "google-crc32c", lambda data: _gmod.value(bytes(data))
    except ImportError:
        return "python", crc32c_python


CRC32C_IMPLEMENTATION, crc32c = _compiled_crc32c()
"""Name of the implementation in use ("crc32c", "google-crc32c" or "python") and the function itself."""


def masked_crc32c(data: bytes | bytearray | memoryview) -> int:
    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------------------------
# TFRecord framing
# ---------------------------------------------------------------------------------------------------------------

HEADER_BYTES = 12  # u64 length + u32 masked crc of the length
FOOTER_BYTES = 4  # u32 masked crc of the payload
# A single record larger than this is treated as a corrupt length (RLDS episodes are MBs, not GBs).
MAX_RECORD_BYTES = 1 << 34


@dataclass(frozen=True)
class RecordIssue:
    """One problem met while reading: the record (or byte range) it concerns was skipped."""

    path: str
    offset: int  # byte offset of the record header (or of the damaged range) in the file
    kind: str  # "length_crc" | "data_crc" | "truncated" | "decode" | "resync"
    message: str

    def __str__(self) -> str:
        return f"{os.path.basename(self.path)}@{self.offset}: {self.kind}: {self.message}"


def frame_record(payload: bytes) -> bytes:
    length = struct.pack("<Q", len(payload))
    return b"".join((length, struct.pack("<I", masked_crc32c(length)), payload,
                     struct.pack("<I", masked_crc32c(payload))))


def write_records(path_or_file: Union[str, os.PathLike, BinaryIO], payloads: Iterable[bytes]) -> list[int]:
    """Write ``payloads`` as a TFRecord file; returns the byte offset of each record."""
    offsets: list[int] = []
    own = not hasattr(path_or_file, "write")
    f = open(path_or_file, "wb") if own else path_or_file  # type: ignore[arg-type]
    try:
        pos = f.tell() if not own else 0
        for payload in payloads:
            framed = frame_record(bytes(payload))
            offsets.append(pos)
            f.write(framed)
            pos += len(framed)
    finally:
        if own:
            f.close()
    return offsets


def _header_ok(buf, pos: int, size: int) -> int | None:
    """Length of the record at ``pos`` when its header CRC checks out and it fits in the file, else None."""
    if pos + HEADER_BYTES > size:
        return None
    (length,) = struct.unpack_from("<Q", buf, pos)
    if length > MAX_RECORD_BYTES or pos + HEADER_BYTES + length + FOOTER_BYTES > size:
        return None  # cheap test first: most byte offsets fail here without a CRC
    (crc,) = struct.unpack_from("<I", buf, pos + 8)
    if masked_crc32c(buf[pos:pos + 8]) != crc:
        return None
    return length


def iter_records(path: Union[str, os.PathLike], issues: list[RecordIssue] | None = None,
                 verify: bool = True, resync: bool = True) -> Iterator[tuple[int, bytes]]:
    """Yield ``(offset, payload)`` for every intact record of a TFRecord file.

    Damaged records are appended to ``issues`` (when given) and skipped. ``verify=False`` skips the payload
    CRC (the length CRC is always checked: a wrong length would derail the whole file).
    """
    path = os.fspath(path)
    sink: list[RecordIssue] = issues if issues is not None else []
    size = os.path.getsize(path)
    if size == 0:
        return
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 0
        while pos < size:
            if pos + HEADER_BYTES > size:
                sink.append(RecordIssue(path, pos, "truncated",
                                        f"{size - pos} trailing bytes, shorter than a record header"))
                return
            length_bytes = buf[pos:pos + 8]
            (stored_len_crc,) = struct.unpack_from("<I", buf, pos + 8)
            (length,) = struct.unpack_from("<Q", buf, pos)
            if masked_crc32c(length_bytes) != stored_len_crc:
                if not resync:
                    sink.append(RecordIssue(path, pos, "length_crc", "length CRC mismatch; rest of file skipped"))
                    return
                nxt = pos + 1
                while nxt < size and _header_ok(buf, nxt, size) is None:
                    nxt += 1
                sink.append(RecordIssue(path, pos, "length_crc",
                                        f"length CRC mismatch; skipped {nxt - pos} bytes to the next valid header"
                                        if nxt < size else "length CRC mismatch; no valid record after it"))
                pos = nxt
                continue
            end = pos + HEADER_BYTES + length + FOOTER_BYTES
            if end > size:
                sink.append(RecordIssue(path, pos, "truncated",
                                        f"record of {length} bytes needs {end - pos} bytes, file has {size - pos}"))
                return
            payload = buf[pos + HEADER_BYTES:pos + HEADER_BYTES + length]
            if verify:
                (stored_crc,) = struct.unpack_from("<I", buf, pos + HEADER_BYTES + length)
                if masked_crc32c(payload) != stored_crc:
                    sink.append(RecordIssue(path, pos, "data_crc",
                                            f"payload CRC mismatch in a record of {length} bytes; record skipped"))
                    pos = end
                    continue
            yield pos, payload
            pos = end


def read_records(path: Union[str, os.PathLike], issues: list[RecordIssue] | None = None,
                 verify: bool = True) -> list[bytes]:
    return [p for _, p in iter_records(path, issues, verify)]


# ---------------------------------------------------------------------------------------------------------------
# Protobuf wire helpers
# ---------------------------------------------------------------------------------------------------------------

class ExampleDecodeError(ValueError):
    """The payload is not a well-formed tf.train.Example."""


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise ExampleDecodeError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise ExampleDecodeError("varint longer than 10 bytes")


def _write_varint(out: bytearray, value: int) -> None:
    value &= (1 << 64) - 1  # negative int64 -> two's complement, 10 bytes
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return


def _iter_fields(buf: memoryview, pos: int, end: int) -> Iterator[tuple[int, int, object]]:
    """Yield (field_number, wire_type, value); value is an int (varint/fixed) or a (start, stop) span."""
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos, end)
            yield field, wire, value
        elif wire == 2:
            n, pos = _read_varint(buf, pos, end)
            if pos + n > end:
                raise ExampleDecodeError(f"field {field}: length {n} runs past the end of its message")
            yield field, wire, (pos, pos + n)
            pos += n
        elif wire == 5:
            if pos + 4 > end:
                raise ExampleDecodeError("truncated fixed32")
            yield field, wire, (pos, pos + 4)
            pos += 4
        elif wire == 1:
            if pos + 8 > end:
                raise ExampleDecodeError("truncated fixed64")
            yield field, wire, (pos, pos + 8)
            pos += 8
        else:
            raise ExampleDecodeError(f"unsupported wire type {wire} (field {field})")


def _to_int64(u: int) -> int:
    return u - (1 << 64) if u >= (1 << 63) else u


# ---------------------------------------------------------------------------------------------------------------
# tf.train.Example
# ---------------------------------------------------------------------------------------------------------------

FeatureValue = Union[list, np.ndarray]
"""A decoded feature: list[bytes] (bytes_list), float32 ndarray (float_list) or int64 ndarray (int64_list)."""


def _decode_feature(buf: memoryview, start: int, stop: int, name: str) -> FeatureValue:
    kind_value: FeatureValue | None = None
    for field, wire, span in _iter_fields(buf, start, stop):
        if wire != 2:
            raise ExampleDecodeError(f"feature {name!r}: unexpected wire type {wire}")
        s, e = span  # type: ignore[misc]
        if field == 1:  # BytesList
            values = []
            for f2, w2, sp in _iter_fields(buf, s, e):
                if f2 == 1 and w2 == 2:
                    values.append(bytes(buf[sp[0]:sp[1]]))
            kind_value = values
        elif field == 2:  # FloatList
            chunks: list[np.ndarray] = []
            for f2, w2, sp in _iter_fields(buf, s, e):
                if f2 != 1:
                    continue
                if w2 == 2:  # packed
                    if (sp[1] - sp[0]) % 4:
                        raise ExampleDecodeError(f"feature {name!r}: packed float list of {sp[1] - sp[0]} bytes")
                    chunks.append(np.frombuffer(buf[sp[0]:sp[1]], dtype="<f4"))
                elif w2 == 5:
                    chunks.append(np.frombuffer(buf[sp[0]:sp[1]], dtype="<f4"))
                else:
                    raise ExampleDecodeError(f"feature {name!r}: float with wire type {w2}")
            kind_value = (np.concatenate(chunks) if chunks else np.zeros(0, "<f4")).astype(np.float32)
        elif field == 3:  # Int64List
            ints: list[int] = []
            for f2, w2, sp in _iter_fields(buf, s, e):
                if f2 != 1:
                    continue
                if w2 == 2:  # packed varints
                    p, q = sp  # type: ignore[misc]
                    while p < q:
                        v, p = _read_varint(buf, p, q)
                        ints.append(_to_int64(v))
                elif w2 == 0:
                    ints.append(_to_int64(sp))  # type: ignore[arg-type]
                else:
                    raise ExampleDecodeError(f"feature {name!r}: int64 with wire type {w2}")
            kind_value = np.asarray(ints, dtype=np.int64)
    if kind_value is None:  # an empty Feature (no kind set) — TF reads it as an empty list
        kind_value = []
    return kind_value


def decode_example(payload: bytes | memoryview) -> dict[str, FeatureValue]:
    """Decode a serialized tf.train.Example into {feature name: values}."""
    buf = memoryview(payload)
    features: dict[str, FeatureValue] = {}
    for field, wire, span in _iter_fields(buf, 0, len(buf)):
        if field != 1 or wire != 2:
            continue
        fs, fe = span  # type: ignore[misc]
        for f2, w2, entry in _iter_fields(buf, fs, fe):
            if f2 != 1 or w2 != 2:
                continue
            key: str | None = None
            value_span = None
            for f3, w3, sp in _iter_fields(buf, entry[0], entry[1]):
                if f3 == 1 and w3 == 2:
                    try:
                        key = bytes(buf[sp[0]:sp[1]]).decode("utf-8")
                    except UnicodeDecodeError as exc:
                        raise ExampleDecodeError(f"feature name is not UTF-8: {exc}") from exc
                elif f3 == 2 and w3 == 2:
                    value_span = sp
            if key is None:
                raise ExampleDecodeError("feature map entry without a key")
            features[key] = (_decode_feature(buf, value_span[0], value_span[1], key) if value_span else [])
    return features


def _len_delimited(out: bytearray, field: int, data: bytes) -> None:
    _write_varint(out, (field << 3) | 2)
    _write_varint(out, len(data))
    out += data


def encode_feature(value, packed: bool = True) -> bytes:
    """Serialize one Feature. bytes/str sequences -> bytes_list, floats -> float_list, ints/bools -> int64_list."""
    inner = bytearray()
    if isinstance(value, (bytes, str)):
        value = [value]
    if isinstance(value, np.ndarray) and value.dtype.kind in "fiub":
        arr = value.reshape(-1)
    elif isinstance(value, (list, tuple)) and value and isinstance(value[0], (bytes, str)):
        for v in value:
            _len_delimited(inner, 1, v.encode("utf-8") if isinstance(v, str) else bytes(v))
        out = bytearray()
        _len_delimited(out, 1, bytes(inner))
        return bytes(out)
    else:
        arr = np.asarray(value).reshape(-1)
        if arr.size == 0:
            arr = arr.astype(np.float32)
    out = bytearray()
    if arr.dtype.kind == "f":
        data = arr.astype("<f4").tobytes()
        if packed:
            _len_delimited(inner, 1, data)
        else:
            for i in range(arr.size):
                _write_varint(inner, (1 << 3) | 5)
                inner += data[4 * i:4 * i + 4]
        _len_delimited(out, 2, bytes(inner))
    elif arr.dtype.kind in "iub":
        ints = [int(x) for x in arr.astype(np.int64)]
        if packed:
            body = bytearray()
            for x in ints:
                _write_varint(body, x)
            _len_delimited(inner, 1, bytes(body))
        else:
            for x in ints:
                _write_varint(inner, (1 << 3) | 0)
                _write_varint(inner, x)
        _len_delimited(out, 3, bytes(inner))
    else:
        raise TypeError(f"cannot encode a feature of dtype {arr.dtype}")
    return bytes(out)


def encode_example(features: Mapping[str, object], packed: bool = True) -> bytes:
    """Serialize {name: values} as a tf.train.Example (keys in sorted order, as TF's serializer does)."""
    fmap = bytearray()
    for name in sorted(features):
        entry = bytearray()
        _len_delimited(entry, 1, name.encode("utf-8"))
        _len_delimited(entry, 2, encode_feature(features[name], packed))
        _len_delimited(fmap, 1, bytes(entry))
    out = bytearray()
    _len_delimited(out, 1, bytes(fmap))
    return bytes(out)


def iter_examples(path: Union[str, os.PathLike], issues: list[RecordIssue] | None = None,
                  verify: bool = True) -> Iterator[tuple[int, dict[str, FeatureValue]]]:
    """Yield (offset, decoded example); records that fail to decode become "decode" issues and are skipped."""
    sink: list[RecordIssue] = issues if issues is not None else []
    for offset, payload in iter_records(path, sink, verify):
        try:
            yield offset, decode_example(payload)
        except ExampleDecodeError as exc:
            sink.append(RecordIssue(os.fspath(path), offset, "decode", f"not a tf.train.Example: {exc}"))
