"""Reading rosbag2 bags for replay: rosbags' reader, and a reader of the complete prefix of an MCAP file cut
short (a recorder killed before its footer). Used by bag_replay.py; no node here, so the readers are tested
without publishing. ``message_class`` maps a bag's type name to its rclpy message class.
"""
from __future__ import annotations

import importlib
import io
import struct
import time
import zlib
from pathlib import Path

def message_class(msgtype: str):
    """'sensor_msgs/msg/Image' -> sensor_msgs.msg.Image (None when the package is not installed)."""
    try:
        pkg, kind, name = msgtype.split("/")
        return getattr(importlib.import_module(f"{pkg}.{kind}"), name)
    except (ValueError, ImportError, AttributeError):
        return None


def decode_jpeg(data) -> "object":
    import numpy as np
    from PIL import Image as PILImage

    with PILImage.open(io.BytesIO(bytes(data))) as im:
        return np.asarray(im.convert("RGB"), dtype=np.uint8)


EXIT_OK, EXIT_UNREADABLE, EXIT_PARTIAL = 0, 2, 3
MCAP_MAGIC = b"\x89MCAP0\r\n"
# rosbags refuses an MCAP file without a valid footer / summary; these are the messages it raises then.
MCAP_TRUNCATION_ERRORS = ("File end magic is invalid", "Invalid MCAP footer", "Invalid MCAP summary offset")


class BagError(ValueError):
    """A bag that cannot be replayed at all (the message says why)."""


class RosbagsSource:
    """A readable rosbag2 bag (rosbags Reader): topics, time range and raw messages."""

    def __init__(self, reader):
        self._reader = reader
        self.start_time, self.end_time = reader.start_time, reader.end_time
        self.topics = [(c.topic, c.msgtype) for c in reader.connections]
        self.note = ""  # what was lost (empty: nothing)

    def messages(self, topics, start):
        conns = [c for c in self._reader.connections if c.topic in topics]
        for conn, t_ns, raw in self._reader.messages(connections=conns, start=start):
            yield conn.topic, t_ns, raw

    def close(self):
        self._reader.close()


class McapPrefixSource:
    """The complete records at the start of an MCAP file whose end is missing (no footer / summary).

    MCAP is a sequence of records ``opcode u8, length u64 LE, content``; a truncated file holds every record up
    to the cut intact. Schema (0x03), Channel (0x04), Message (0x05) and Chunk (0x06, holding those, possibly
    compressed) records are read in file order; the scan stops at the first record that does not fit in the file
    or cannot be parsed, and ``valid_bytes`` says where."""

    def __init__(self, path: Path, reason: str):
        self.path = Path(path)
        self.file_bytes = self.path.stat().st_size
        self.channels: dict[int, tuple[str, str]] = {}  # id -> (topic, msgtype)
        self.valid_bytes = 0
        self.stop_reason = ""
        self.message_count = 0
        self.start_time, self.end_time = 2**63 - 1, 0
        schemas: dict[int, str] = {}
        for kind, rec in self._records():
            if kind == 0x03:
                sid, name = rec
                schemas[sid] = name
            elif kind == 0x04:
                cid, sid, topic = rec
                self.channels[cid] = (topic, schemas.get(sid, "?"))
            elif kind == 0x05:
                self.message_count += 1
                self.start_time = min(self.start_time, rec[1])
                self.end_time = max(self.end_time, rec[1])
        if not self.message_count:
            raise BagError(f"{self.path}: MCAP file truncated ({reason}) and no complete message before the cut "
                           f"({self.stop_reason or 'empty'})")
        self.topics = sorted(set(self.channels.values()))
        self.note = (f"MCAP file {self.path.name} is truncated ({reason}): replaying the {self.message_count} "
                     f"complete messages in its first {self.valid_bytes} of {self.file_bytes} bytes"
                     f" ({self.stop_reason})")

    @staticmethod
    def _string(buf: bytes, off: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<I", buf, off)
        if off + 4 + n > len(buf):
            raise ValueError("string runs past its record")
        return buf[off + 4:off + 4 + n].decode("utf-8"), off + 4 + n

    def _parse(self, op: int, body: bytes):
        if op == 0x03:
            (sid,) = struct.unpack_from("<H", body, 0)
            name, _ = self._string(body, 2)
            return sid, name
        if op == 0x04:
            cid, sid = struct.unpack_from("<HH", body, 0)
            topic, _ = self._string(body, 4)
            return cid, sid, topic
        if op == 0x05:
            cid, _seq, log_time = struct.unpack_from("<HIQ", body, 0)
            return cid, log_time, body[22:]
        return None

    def _chunk_records(self, body: bytes):
        _t0, _t1, size, crc = struct.unpack_from("<QQQI", body, 0)
        compression, off = self._string(body, 28)
        (clen,) = struct.unpack_from("<Q", body, off)
        data = body[off + 8:off + 8 + clen]
        if len(data) != clen:
            raise ValueError("chunk data runs past its record")
        if compression:
            from rosbags.rosbag2.storage_mcap import decompress  # zstd / lz4, with the CRC check

            data = decompress(data, compression, size, crc)
        elif crc and zlib.crc32(data) != crc:
            raise ValueError("chunk checksum mismatch")
        pos, out = 0, []
        while pos < len(data):
            op, length = struct.unpack_from("<BQ", data, pos)
            inner = data[pos + 9:pos + 9 + length]
            if len(inner) != length:
                raise ValueError("record runs past its chunk")
            out.append((op, inner))
            pos += 9 + length
        return out

    def _cut_chunk(self, body: bytes, pos: int):
        """The complete records of an uncompressed chunk whose end is missing (the file was cut inside it)."""
        try:
            compression, off = self._string(body, 28)
        except (struct.error, ValueError, UnicodeDecodeError):
            return
        if compression:  # a compressed stream cut short cannot be decoded
            return
        off += 8  # records length: what the chunk should have held
        while off + 9 <= len(body):
            op, length = struct.unpack_from("<BQ", body, off)
            if off + 9 + length > len(body):
                break
            try:
                rec = self._parse(op, body[off + 9:off + 9 + length])
            except Exception:
                break
            off += 9 + length
            self.valid_bytes = pos + 9 + off
            if rec is not None:
                yield op, rec

    def _records(self):
        """(opcode, parsed) of every complete schema / channel / message record, in file order."""
        with open(self.path, "rb") as f:
            if f.read(8) != MCAP_MAGIC:
                self.stop_reason = "bad file magic"
                return
            pos = 8
            while True:
                head = f.read(9)
                if len(head) < 9:
                    self.stop_reason = "file ends inside a record header" if head else "file ends"
                    break
                op, length = struct.unpack("<BQ", head)
                if length > self.file_bytes - pos - 9:
                    self.stop_reason = f"record at byte {pos} (opcode 0x{op:02x}) cut short"
                    if op == 0x06:  # an uncompressed chunk cut short still holds complete records
                        for o, rec in self._cut_chunk(f.read(), pos):
                            yield o, rec
                    break
                body = f.read(length)
                if op in (0x02, 0x0F):  # footer / data end: the data section is complete
                    self.valid_bytes = pos + 9 + length
                    self.stop_reason = "end of data"
                    break
                try:
                    inner = self._chunk_records(body) if op == 0x06 else [(op, body)]
                    parsed = [(o, self._parse(o, b)) for o, b in inner]
                except Exception as exc:  # a damaged record: everything before it is still good
                    self.stop_reason = f"record at byte {pos} (opcode 0x{op:02x}) unreadable: {exc}"
                    break
                pos += 9 + length
                self.valid_bytes = pos
                for o, rec in parsed:
                    if rec is not None:
                        yield o, rec

    def messages(self, topics, start):
        for kind, rec in self._records():
            if kind == 0x04:
                cid, sid, topic = rec
                self.channels.setdefault(cid, (topic, "?"))
            elif kind == 0x05:
                cid, t_ns, raw = rec
                topic = self.channels.get(cid, ("", ""))[0]
                if topic in topics and t_ns >= start:
                    yield topic, t_ns, raw

    def close(self):
        pass


def _metadata_files(path: Path) -> tuple[str, list[Path]]:
    """(storage identifier, data files) from metadata.yaml; ('', []) when it cannot be parsed."""
    import yaml

    try:
        info = (yaml.safe_load((path / "metadata.yaml").read_text()) or {})["rosbag2_bagfile_information"]
        return str(info.get("storage_identifier", "")), [path / p for p in info.get("relative_file_paths", [])]
    except Exception:
        return "", []


def open_bag(bag: str):
    """A message source for ``bag`` (a rosbag2 directory), or BagError saying why it cannot be replayed."""
    from rosbags.rosbag2 import Reader

    path = Path(bag)
    if not path.exists():
        raise BagError(f"bag {bag} does not exist")
    if not path.is_dir():
        raise BagError(f"bag {bag} is not a directory (a rosbag2 bag is a directory holding metadata.yaml and "
                       f"the data files)")
    if not (path / "metadata.yaml").is_file():
        data = sorted(p.name for p in path.iterdir() if p.suffix in (".mcap", ".db3"))
        raise BagError(f"bag {bag}: metadata.yaml is missing" + (
            f" (data files present: {', '.join(data)}; `ros2 bag reindex {bag}` rebuilds it)" if data else
            " and no .mcap / .db3 data file: not a rosbag2 bag"))
    reader = Reader(path)
    try:
        reader.open()
    except Exception as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        storage, files = _metadata_files(path)
        if any(m in str(exc) for m in MCAP_TRUNCATION_ERRORS) and len(files) == 1 and files[0].suffix == ".mcap":
            return McapPrefixSource(files[0], text)
        raise BagError(f"bag {bag} cannot be read" + (f" ({storage})" if storage else "") + f": {text}") from None
    return RosbagsSource(reader)
