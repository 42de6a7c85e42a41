"""The `.stage` wire format (distorefs/stagewire.py): requests, some with a file's bytes,
cut out of the WRITEs the kernel makes of one write() wherever it cuts them."""

import json

import pytest

from distorefs.errors import InvalidArgument
from distorefs.stagewire import HELD_MAX, INLINE_MAX, StageStream, encode

BATCH = [({"src": "/s/a", "path": "a"}, b"A" * 1000),
         ({"src": "/s/b", "path": "b"}, None),  # a path alone: the daemon reads it
         ({"src": "/s/c", "path": "c"}, b""),
         ({"src": "/s/d", "path": "d"}, b"line\nbreaks\n\n in the bytes\n")]
WIRE = b"".join(encode(r, d) for r, d in BATCH)
ENDS = [len(b"".join(encode(r, d) for r, d in BATCH[:i])) for i in range(1, len(BATCH))]
CUTS = sorted({c for end in ENDS for c in (end - 1, end, end + 1)} | set(range(1, len(WIRE), 41)))


def expected() -> list:
    return [{**r, "data": d} if d is not None else r for r, d in BATCH]


@pytest.mark.parametrize("cut", CUTS)
def test_a_batch_cut_anywhere_is_handed_on_whole_at_its_end(cut):
    stream = StageStream()
    first = stream.feed(WIRE[:cut])
    rest = stream.feed(WIRE[cut:])
    if cut in ENDS:  # the first WRITE ended where a request ends: those go on their own
        assert first + rest == expected() and first and rest
    else:
        assert first == [] and rest == expected()


def test_requests_of_paths_alone_and_non_objects_pass_through():
    stream = StageStream()
    assert stream.feed(b'{"src": "/x", "path": "x"}\n\n[1, 2]\n') == [{"src": "/x", "path": "x"}, [1, 2]]


@pytest.mark.parametrize("wire, why", [
    (b"{not json}\n", "not a JSON line"),
    (b'{"path": "a", "data": -1}\n', "0 to"),
    (b'{"path": "a", "data": "12"}\n12', "0 to"),
    (b'{"path": "a", "data": %d}\n' % (INLINE_MAX + 1), "0 to"),
])
def test_a_malformed_request_is_refused_and_nothing_is_kept(wire, why):
    stream = StageStream()
    assert stream.feed(encode({"path": "kept?"}, b"x" * 10)[:-3]) == []  # a request still coming
    with pytest.raises(InvalidArgument, match=why):
        stream.feed(b"xyz" + wire)
    assert stream.feed(encode({"path": "next"})) == [{"path": "next"}]  # what was held went with the error


def test_what_a_handle_holds_is_bounded():
    stream = StageStream()
    big = json.dumps({"path": "p"}).encode()[:-1]  # a line that never ends
    stream.feed(big)
    with pytest.raises(InvalidArgument, match="without the end of a request"):
        stream.feed(b" " * HELD_MAX)
    assert stream.feed(encode({"path": "q"}, b"ok")) == [{"path": "q", "data": b"ok"}]
