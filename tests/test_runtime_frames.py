"""``runtime.worker.FrameReader``: a connection's messages read off its descriptor, many a read, as
``Connection.recv`` would give them."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import struct
import threading
import time

import pytest
import torch

from kernelplan.runtime.worker import FrameReader


@pytest.fixture
def pipe():
    a, b = multiprocessing.get_context("spawn").Pipe()
    yield a, b
    a.close()
    b.close()


def test_messages_come_in_order_many_from_one_read(pipe):
    a, b = pipe
    sent = [("run", i, os.urandom(i % 300)) for i in range(200)] + [("ok", 7, torch.arange(5))]
    for m in sent[:-1]:
        a.send_bytes(pickle.dumps(m))
    a.send(sent[-1])  # through the ForkingPickler, as a message with a tensor goes
    reader = FrameReader(b)
    got = [reader.recv() for _ in sent]
    assert got[:-1] == sent[:-1] and torch.equal(got[-1][2], sent[-1][2])
    assert not reader.pending() and not reader.ready()


def test_a_message_split_across_reads_is_assembled(pipe):
    a, b = pipe
    blob = os.urandom(150_000)  # more than one read's 64 KiB
    payload = pickle.dumps(("big", 1, blob))
    raw = struct.pack("!i", len(payload)) + payload

    def dribble():
        cuts = [0, 2] + list(range(9973, len(raw), 9973)) + [len(raw)]  # the header itself is split too
        for lo, hi in zip(cuts, cuts[1:]):
            os.write(a.fileno(), raw[lo:hi])
            time.sleep(0.0005)

    writer = threading.Thread(target=dribble)
    writer.start()
    reader = FrameReader(b)
    assert reader.recv() == ("big", 1, blob)
    writer.join()


def test_the_long_header_form_and_end_of_stream(pipe):
    a, b = pipe
    payload = pickle.dumps(("long", 2, None))
    os.write(a.fileno(), struct.pack("!i", -1) + struct.pack("!Q", len(payload)) + payload)
    reader = FrameReader(b)
    assert reader.ready() and reader.recv() == ("long", 2, None)
    a.close()
    with pytest.raises(EOFError):
        reader.recv()
