"""The wire format both sides import (streamer_client._protocol): round trips and error bodies."""

from __future__ import annotations

import json
import pickle

from streamer_client import _protocol as protocol
from streamer_client import errors
from streamer_client._protocol import Handle, JoinReply, NextReply


def _wire(obj):
    return json.loads(json.dumps(obj.to_wire()))  # what crosses the socket


def test_replies_round_trip_through_json():
    handles = (
        Handle(0, "streamer-1-ab-1", 4096, 12, "w", "BF16", (2, 3), False),
        Handle(1, None, 0, 0, "empty", "F32", (0,), False),
        Handle(2, "streamer-1-ab-2", 0, 1 << 33, "big", "U8", (1 << 33,), True),
    )
    assert NextReply.from_wire(_wire(NextReply(handles, True))) == NextReply(handles, True)
    joined = JoinReply("id", 3, 1 << 33, "/cache/x", "/dev/shm")
    assert JoinReply.from_wire(_wire(joined)) == joined


def test_error_bodies_become_the_same_error_again():
    body = json.loads(json.dumps(protocol.error_body("SelectionError", "entry 'x' matches nothing", uri="s3://b/m", key="x")))
    error = protocol.error_from_body(body, 400, "/run/d.sock")
    assert type(error) is errors.SelectionError and isinstance(error, ValueError)
    assert (error.message, error.uri, error.key) == ("entry 'x' matches nothing", "s3://b/m", "x")
    assert pickle.loads(pickle.dumps(error)).key == "x"


def test_unknown_or_foreign_error_bodies_are_still_errors():
    unknown = protocol.error_from_body(protocol.error_body("NoSuchError", "m"), 500, "/s")
    assert type(unknown) is errors.StreamerError and unknown.message == "m"
    foreign = protocol.error_from_body({"detail": "Not Found"}, 404, "/s")
    assert type(foreign) is errors.DaemonError and "/s answered 404" in str(foreign)
    # A class name that is not an error class is not instantiated.
    assert type(protocol.error_from_body(protocol.error_body("Path", "m"), 500, "/s")) is errors.StreamerError


def test_paths():
    assert protocol.rank_path("abc", 3, "next") == "/v1/sessions/abc/ranks/3/next"
    assert protocol.JOIN_PATH == "/v1/sessions/join"


def test_daemon_stats_parse_back_from_their_json():
    """The demo and the benchmarks read another daemon's /v1/stats as DaemonStats: the JSON
    (the public contract) and the dataclasses must say the same, ranks and resident copies too."""
    from streamer_service.daemon.stats import DaemonStats, RankSummary, ResidentStats, SessionSummary

    ranks = {0: RankSummary("active", 10, 4, waiting=1), 1: RankSummary("failed", 5, 0, error="could not map")}
    ended = SessionSummary("id1", "launch:uri", "s3://b/m", "failed", 2, 15, 0, None, ranks, "rank 1 failed: could not map")
    stats = DaemonStats(
        shm_budget=1 << 30, shm_in_use=0, shm_peak=1 << 20, shm_page_size=2 << 20, segments_idle=2, segments_reused=3,
        bytes_read=15, resident=ResidentStats(1 << 30, 7, ({"uri": "s3://b/m", "bytes": 7, "tensors": 1, "pins": 0},), 7, 0),
        finished=(ended,),
    )  # fmt: skip
    body = json.loads(json.dumps(stats.to_json()))  # as it comes over HTTP: rank keys become strings
    assert DaemonStats.from_json(body) == stats


def test_request_bodies_have_the_fields_the_daemon_validates():
    from streamer_service.daemon import api

    for name, wire_fields in protocol.request_fields().items():
        assert tuple(getattr(api, name).model_fields) == wire_fields, name


def test_request_bodies_are_accepted_by_the_daemon_as_the_client_builds_them():
    from streamer_service.daemon import api

    bodies = [
        protocol.MetadataRequest("s3://b/m", None, "launch"),
        protocol.JoinRequest(uri="s3://b/m", session="k", rank=1, world_size=2, select=["a."], priority=None, launch_id="l"),
        protocol.JoinRequest(uri="s3://b/m", session="k", rank=0, world_size=1, pins=True),
        protocol.JoinRequest(uri="s3://b/m", session="k", rank=0, world_size=1, slices={"w": [[1, 0, 8], [1, 16, 24]]}),
        protocol.NextRequest([0, 1], 0.5),
        protocol.LeaveRequest("RuntimeError: boom"),
        protocol.LeaveRequest(),
    ]
    for body in bodies:
        parsed = getattr(api, type(body).__name__).model_validate(json.loads(json.dumps(body.to_wire())))
        assert parsed.model_dump(exclude_unset=True) == body.to_wire()
    assert protocol.MetadataReply.from_wire(_wire(protocol.MetadataReply("/cache/x"))) == protocol.MetadataReply("/cache/x")


def test_a_join_request_without_slices_leaves_the_field_off_the_wire_for_a_daemon_from_before_them():
    body = protocol.JoinRequest(uri="s3://b/m", session="k", rank=0, world_size=1)
    assert "slices" not in body.to_wire()
    assert protocol.JoinRequest(uri="s", session="k", rank=0, world_size=1, slices={"w": [[0, 0, 1]]}).to_wire()["slices"] == {
        "w": [[0, 0, 1]]
    }


def test_a_join_reply_carries_the_segments_page_size_whether_they_are_in_memory_and_the_ring_and_an_older_daemon_s_reads_as_unknown():
    reply = protocol.JoinReply("s1", 3, 4096, "/cache/m", "/dev/shm/streamer", 2 << 20, True, 8)
    assert protocol.JoinReply.from_wire(_wire(reply)) == reply
    older = protocol.JoinReply.from_wire(
        {k: v for k, v in reply.to_wire().items() if k not in ("shm_page_size", "from_memory", "ring_slots")}
    )
    assert (older.shm_page_size, older.from_memory, older.ring_slots) == (0, False, 0)


def test_a_cuda_rank_stages_segments_in_memory_and_a_first_load_of_small_page_ones_with_auto(monkeypatch):
    from streamer_client import _receiver as receiver

    monkeypatch.setattr(receiver.copier, "available", lambda: True)
    assert receiver.staged("auto", reloading=False, huge_pages=False)
    assert not receiver.staged("auto", reloading=True, huge_pages=False)
    assert not receiver.staged("auto", reloading=False, huge_pages=True)  # registering huge pages is cheap
    assert not receiver.staged("auto", reloading=False, huge_pages=False, recycled=True)  # a ring's slots: registered once
    # Segments whole in memory are staged, first load or reload, small pages or huge.
    assert all(
        receiver.staged("auto", reloading, huge, from_memory=True, recycled=recycled)
        for reloading in (False, True) for huge in (False, True) for recycled in (False, True)
    )  # fmt: skip
    assert [receiver.staged(p, False, huge) for p in ("never", "always") for huge in (False, True)] == [True, True, False, False]
    monkeypatch.setattr(receiver.copier, "available", lambda: False)  # no copier: no staging ring either
    assert not receiver.staged("auto", reloading=False, huge_pages=False)


def test_error_texts_are_clipped_to_the_limit_keeping_start_end_and_the_count():
    assert protocol.clipped(None) is None
    exact = "e" * protocol.ERROR_TEXT_LIMIT
    assert protocol.clipped(exact) == exact  # at the limit: as it is
    text = "entry '" + "x" * 10**6 + "' matches no tensor"
    short = protocol.clipped(text)
    assert len(short) <= protocol.ERROR_TEXT_LIMIT
    head, rest = short.split(" ... [", 1)
    count, tail = rest.split(" characters left out] ... ", 1)
    assert text.startswith(head) and text.endswith(tail) and tail.endswith("' matches no tensor")
    assert len(head) + int(count) + len(tail) == len(text)
    body = protocol.error_body("SelectionError", text, uri="/m/" + "d" * 10**5, key="k" * 10**5)
    assert all(len(v) <= protocol.ERROR_TEXT_LIMIT for k, v in body["error"].items() if k != "type")
