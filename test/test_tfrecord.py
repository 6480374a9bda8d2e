"""TFRecord framing, CRC-32C and tf.train.Example coding (no TensorFlow)."""
import struct

import numpy as np
import pytest

from vla_edge_ros.data import tfrecord as tfr


def test_crc32c_known_vectors_both_implementations():
    # RFC 3720 / iSCSI check value and the all-zero 32-byte vector.
    assert tfr.crc32c_python(b"123456789") == 0xE3069283
    assert tfr.crc32c_python(bytes(32)) == 0x8A9136AA
    assert tfr.crc32c(b"123456789") == 0xE3069283
    data = bytes(range(256)) * 7
    assert tfr.crc32c(data) == tfr.crc32c_python(data)


def test_masked_crc_matches_tensorflow_formula():
    crc = tfr.crc32c(b"abc")
    assert tfr.masked_crc32c(b"abc") == ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def test_record_round_trip(tmp_path):
    payloads = [b"", b"x", bytes(range(256)) * 40, b"last"]
    path = tmp_path / "a.tfrecord"
    offsets = tfr.write_records(path, payloads)
    issues = []
    got = list(tfr.iter_records(path, issues))
    assert [p for _, p in got] == payloads
    assert [o for o, _ in got] == offsets
    assert issues == []
    # framing: u64 length then masked crc of it
    raw = path.read_bytes()
    assert struct.unpack_from("<Q", raw, offsets[2])[0] == len(payloads[2])


def test_payload_crc_corruption_is_skipped_and_reported(tmp_path):
    payloads = [b"first" * 10, b"second" * 10, b"third" * 10]
    path = tmp_path / "c.tfrecord"
    offsets = tfr.write_records(path, payloads)
    raw = bytearray(path.read_bytes())
    raw[offsets[1] + tfr.HEADER_BYTES + 3] ^= 0xFF  # flip a payload byte of record 1
    path.write_bytes(bytes(raw))
    issues = []
    got = tfr.read_records(path, issues)
    assert got == [payloads[0], payloads[2]]
    assert len(issues) == 1 and issues[0].kind == "data_crc" and issues[0].offset == offsets[1]
    assert "c.tfrecord" in str(issues[0])


def test_length_crc_corruption_resyncs_to_next_record(tmp_path):
    payloads = [b"a" * 50, b"b" * 60, b"c" * 70]
    path = tmp_path / "l.tfrecord"
    offsets = tfr.write_records(path, payloads)
    raw = bytearray(path.read_bytes())
    raw[offsets[1]] ^= 0x01  # corrupt the length of record 1
    path.write_bytes(bytes(raw))
    issues = []
    got = tfr.read_records(path, issues)
    assert got == [payloads[0], payloads[2]]
    assert [i.kind for i in issues] == ["length_crc"] and issues[0].offset == offsets[1]
    assert str(offsets[2] - offsets[1]) in issues[0].message  # bytes skipped to the next header


def test_truncated_file_reports_and_keeps_earlier_records(tmp_path):
    payloads = [b"one" * 20, b"two" * 20, b"three" * 20]
    path = tmp_path / "t.tfrecord"
    offsets = tfr.write_records(path, payloads)
    raw = path.read_bytes()
    path.write_bytes(raw[:offsets[2] + 20])  # cut inside record 2's payload
    issues = []
    assert tfr.read_records(path, issues) == payloads[:2]
    assert len(issues) == 1 and issues[0].kind == "truncated" and issues[0].offset == offsets[2]
    # cut inside a header
    path.write_bytes(raw[:offsets[1] + 5])
    issues = []
    assert tfr.read_records(path, issues) == payloads[:1]
    assert issues[0].kind == "truncated" and issues[0].offset == offsets[1]


def test_empty_file_has_no_records(tmp_path):
    path = tmp_path / "e.tfrecord"
    path.write_bytes(b"")
    issues = []
    assert tfr.read_records(path, issues) == [] and issues == []


@pytest.mark.parametrize("packed", [True, False])
def test_example_round_trip(packed):
    feats = {
        "steps/image": [b"\xff\xd8jpeg0", b"\xff\xd8jpeg1"],
        "steps/action": np.array([0.5, -1.25, 3.0e-7, 1e30], np.float32),
        "steps/is_first": np.array([1, 0], np.int64),
        "ints": np.array([-1, 0, 2**40, -(2**63), 2**63 - 1], np.int64),
        "empty_floats": np.zeros(0, np.float32),
        "text": ["héllo"],
    }
    dec = tfr.decode_example(tfr.encode_example(feats, packed=packed))
    assert dec["steps/image"] == feats["steps/image"]
    np.testing.assert_array_equal(dec["steps/action"], feats["steps/action"])
    assert dec["steps/action"].dtype == np.float32
    np.testing.assert_array_equal(dec["steps/is_first"], [1, 0])
    np.testing.assert_array_equal(dec["ints"], feats["ints"])
    assert dec["ints"].dtype == np.int64
    assert dec["text"] == ["héllo".encode()]
    assert len(dec["empty_floats"]) == 0
    assert set(dec) == set(feats)


def test_packed_and_unpacked_encodings_differ_but_decode_equal():
    feats = {"f": np.arange(5, dtype=np.float32), "i": np.arange(5, dtype=np.int64)}
    a, b = tfr.encode_example(feats, packed=True), tfr.encode_example(feats, packed=False)
    assert a != b
    da, db = tfr.decode_example(a), tfr.decode_example(b)
    for k in feats:
        np.testing.assert_array_equal(da[k], db[k])


def test_garbage_payload_is_a_decode_issue(tmp_path):
    good = tfr.encode_example({"x": np.array([1], np.int64)})
    path = tmp_path / "g.tfrecord"
    offsets = tfr.write_records(path, [good, b"\x0a\xff\xff\xff\xff\x0f", good])  # length runs past the end
    issues = []
    got = list(tfr.iter_examples(path, issues))
    assert [o for o, _ in got] == [offsets[0], offsets[2]]
    assert [i.kind for i in issues] == ["decode"] and issues[0].offset == offsets[1]
    with pytest.raises(tfr.ExampleDecodeError):
        tfr.decode_example(b"\x0f")  # wire type 7
