"""One vLLM server (`trl vllm-serve`) for every client trainer of a process: TRL's server mode in a federation.

With `use_vllm=True, vllm_mode="server"`, each `GRPOTrainer` builds a `VLLMGeneration`, whose main process makes a
`trl.generation.vllm_client.VLLMClient` and opens a weight-sync group to the server with it (`init_communicator`: an
NCCL group whose rendezvous the trainer hosts on `vllm_group_port`, closed only at exit). Before the trainer's
first generation, and again after every optimizer step, it pushes the model's merged weights (base + LoRA) through
that group (`sync_weights`, called whenever `state.global_step` differs from `_last_loaded_step`, which a new
trainer sets to -1): every client trainer, fresh at global step 0, loads its own weights into the server before it
generates, never the previous client's.

A TRL run builds one trainer; a federation builds one per client and round. `reuse_vllm_client` lets all of them
share the first one's client and weight-sync group, as the steps of one long TRL run do, instead of opening a group
per client-round on the same port while the previous ones stay open. The clients of a process take turns (the
runner trains them one after another), so one group, and the server's one set of weights, serve them all; clients
in parallel processes are refused (`FedGRPOConfig.check_vllm`).
"""

from __future__ import annotations

import contextlib
import functools

from trl.generation import vllm_generation

# This process's clients, one per (client class, server URL, weight-sync port).
_clients: dict[tuple[type, str, int], object] = {}


@contextlib.contextmanager
def reuse_vllm_client():
    """While a trainer is built: TRL's `VLLMClient`, as `trl.generation.vllm_generation` names it, replaced by a
    factory that returns this process's client of the same server, made and connected by the first trainer."""
    client_class = vllm_generation.VLLMClient

    def shared_client(base_url: str, group_port: int, connection_timeout: float):
        key = (client_class, base_url, group_port)
        if key not in _clients:
            _clients[key] = _connecting_once(client_class)(
                base_url=base_url, group_port=group_port, connection_timeout=connection_timeout
            )
        return _clients[key]

    vllm_generation.VLLMClient = shared_client
    try:
        yield
    finally:
        vllm_generation.VLLMClient = client_class


@functools.cache
def _connecting_once(client_class: type) -> type:
    """`client_class` whose `init_communicator` opens the weight-sync group only while it has none open."""

    class ReusedVLLMClient(client_class):
        def init_communicator(self, device=0):
            if self.communicator is None:
                super().init_communicator(device)

    return ReusedVLLMClient
