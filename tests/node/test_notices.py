"""Which side of a sidecar a transfer's notification is for: the mode the sender writes into it
(``DataPlane.notice``) and the route the receiver takes from it (``notices.side_for``)."""

from __future__ import annotations

from kvsidecar.v1 import common_pb2, peer_pb2
from sidecar.config import Settings
from sidecar.core.notices import side_for
from sidecar.dataplane.plane import DataPlane
from sidecar.dataplane.views import EngineView, TransferJob
from tests.support.fake_transport import FakeFabric


def test_a_notice_names_the_side_it_is_for_and_an_older_ones_is_routed_by_its_request() -> None:
    assert side_for(common_pb2.TRANSFER_MODE_PULL, True) == "producer"
    assert side_for(common_pb2.TRANSFER_MODE_PUSH, False) == "consumer"
    assert side_for(common_pb2.TRANSFER_MODE_UNSPECIFIED, True) == "consumer"
    assert side_for(common_pb2.TRANSFER_MODE_UNSPECIFIED, False) == "producer"


def test_the_data_plane_writes_the_transfers_mode_into_its_notice() -> None:
    transport = FakeFabric().transport(Settings().nixl, lambda batch, seen_at: None, lambda op, result: None)
    plane = DataPlane(transport, "sidecar-a")
    target = EngineView("decode-0", "127.0.0.1:1", "sidecar-b", 1, 1, "hash", "gen", ())
    for op, mode in (("READ", common_pb2.TRANSFER_MODE_PULL), ("WRITE", common_pb2.TRANSFER_MODE_PUSH)):
        job = TransferJob(op, [], 1, target, ((0,),), ((0,),), "req-1", "t-1", timeout=1.0)
        notice = peer_pb2.TransferNotice.FromString(plane.notice(job, 0))
        assert notice.mode == mode and notice.request_id == "req-1" and notice.sender_sidecar_id == "sidecar-a"
