"""`FederatedServer` (trl_federated/core/server.py) enforces the transport contract, so that no driver has to remember
it: a round's updates join in the clients' index order (`accept` refuses another order, `accept_in_order` sorts), and
`session` closes the server however the run ends. The round's steps themselves are tested where their concern is:
admission in test_admission.py and test_untrusted.py, aggregation in test_aggregation.py, checkpoints and resumes in
test_reliability.py, the round log in test_round_log.py."""

import pytest

from test_untrusted import make_server, moved
from trl_federated import ClientUpdate
from trl_federated.core import checkpoint
from trl_federated.core.server import TransportContractError


def admitted(server, client_id, direction=1.0):
    sent = ClientUpdate(client_id, server.wire.encode(moved(server, direction), server.global_state), 10, 0.5)
    return server.admit(client_id, sent)


def test_a_rounds_updates_join_in_the_clients_index_order(tmp_path, tiny_model_dir, fast_args):
    server = make_server(tiny_model_dir, fast_args, output_dir=str(tmp_path / "run"))
    with server.session():
        server.begin_round(0)
        for index, client_id in enumerate(("a", "b", "c")):
            server.broadcast(client_id, index)
        updates = {client_id: admitted(server, client_id) for client_id in ("a", "b", "c")}
        server.accept(updates["b"])
        with pytest.raises(TransportContractError, match=r"client 'a' \(index 0\) was accepted after that of 'b'"):
            server.accept(updates["a"])
        server.accept(updates["c"])
        assert [update.client_id for update in server._round.updates] == ["b", "c"]
        # a driver whose replies come in any order hands them over at once: the server sorts them
        server.begin_round(1)
        for index, client_id in ((2, "c"), (0, "a"), (1, "b")):
            server.broadcast(client_id, index)
        server.accept_in_order([admitted(server, client_id, -1.0) for client_id in ("c", "a", "b")])
        assert [update.client_id for update in server._round.updates] == ["a", "b", "c"]
        assert sorted(server.end_round().weights) == ["a", "b", "c"]


def test_without_indices_the_broadcast_order_is_the_index_order(tmp_path, tiny_model_dir, fast_args):
    server = make_server(tiny_model_dir, fast_args, output_dir=str(tmp_path / "run"))
    with server.session():
        server.begin_round(0)
        for client_id in ("a", "b"):
            server.broadcast(client_id)
        first, second = admitted(server, "a"), admitted(server, "b")
        server.accept(second)
        with pytest.raises(TransportContractError):
            server.accept(first)


def test_a_session_closes_the_server_however_the_run_ends(tmp_path, tiny_model_dir, fast_args):
    output_dir = tmp_path / "run"
    server = make_server(tiny_model_dir, fast_args, output_dir=str(output_dir))
    with pytest.raises(RuntimeError, match="the driver failed"):
        with server.session() as first_round:
            assert first_round == 0 and output_dir.resolve() in checkpoint._HELD_LOCKS
            raise RuntimeError("the driver failed")
    assert output_dir.resolve() not in checkpoint._HELD_LOCKS
