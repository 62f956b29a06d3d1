"""The connector's settings, from ``kv_connector_extra_config`` (docs/vllm.md, "Settings").

Every key is optional; a wrong value is refused when vLLM builds the connector, naming the key,
the value seen and what it takes.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

TRANSPORTS = ("tcp", "nixl")
# The prefill's bootstrap server listens here unless `bootstrap_port` says otherwise.
DEFAULT_BOOTSTRAP_PORT = 8998


@dataclasses.dataclass(frozen=True)
class Settings:
    #: kvbridge transport: tcp (any host) or nixl (NIXL's UCX; a kvbridge wheel built with NIXL).
    transport: str = "tcp"
    #: The IP this server's kvbridge endpoints listen on and name to peers (default: vLLM's
    #: ``VLLM_HOST_IP``, else 127.0.0.1).
    host: str = "127.0.0.1"
    #: The prefill's bootstrap server port (the decode learns it from the request).
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    #: Seconds each side waits for the other: a prefill keeps a finished request's blocks this
    #: long for its decode to ask (then as long again for the transfer to end), and a decode
    #: that asked waits this long for the KV (in the concurrent flow, the prefill's queue and
    #: compute too). Then the room fails and the blocks are freed.
    waiting_timeout: float = 120.0
    #: Seconds one batch of the prefill's writes may take from its post to its completion.
    transfer_timeout: float = 30.0
    #: Seconds a decode waits for the prefill to answer its request for a room.
    bootstrap_timeout: float = 30.0
    #: Seconds each control message from the decode to a prefill may take (SGLang's decode
    #: allows 1 s; a loaded host can take longer to read its first one).
    control_timeout: float = 5.0
    #: Seconds a peer may stay silent before its rooms fail as lost: the TCP transport's
    #: keep-alive timeout (tcp) and two of the decode's heartbeats to its prefills (SGLang's
    #: 5 s apart). Raise it where other processes can hold every CPU for longer (a vLLM decode
    #: at TP 2 on a two-CPU host stopped its prefill for up to 65 s: docs/vllm.md, "Liveness").
    peer_timeout: float = 10.0
    #: Concurrent flow, prefill: send each layer's rows as the forward pass computes it
    #: (``save_kv_layer``); ``false`` sends a step's rows once its forward pass ended.
    layerwise: bool = True

    @classmethod
    def from_extra(cls, extra: Optional[Mapping[str, Any]], env: Mapping[str, str] = os.environ) -> "Settings":
        extra = dict(extra or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in extra if k not in known)
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config has unknown key(s) {unknown} for KvbridgeConnector; "
                f"it takes {sorted(known)}"
            )
        values: dict = {"host": env.get("VLLM_HOST_IP") or cls.host}
        for key, value in extra.items():
            values[key] = value
        s = cls(**values)
        s._validate()
        return s

    def _validate(self) -> None:
        def bad(key: str, value: Any, takes: str) -> ValueError:
            return ValueError(
                f"kv_connector_extra_config[{key!r}] = {value!r} is not valid for "
                f"KvbridgeConnector: it takes {takes}"
            )

        if self.transport == "shm":
            raise bad(
                "transport", self.transport,
                " or ".join(TRANSPORTS) + " (kvbridge's shared-memory transport writes only into "
                "memory it allocated itself, and vLLM allocates its KV cache; on one host, tcp "
                "runs over loopback)",
            )
        if self.transport not in TRANSPORTS:
            raise bad("transport", self.transport, " or ".join(TRANSPORTS))
        if not isinstance(self.host, str) or not self.host:
            raise bad("host", self.host, "an IP address (string)")
        port = self.bootstrap_port
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise bad("bootstrap_port", port, "a TCP port number (1-65535)")
        if not isinstance(self.layerwise, bool):
            raise bad("layerwise", self.layerwise, "true or false")
        for key in ("waiting_timeout", "transfer_timeout", "bootstrap_timeout", "control_timeout", "peer_timeout"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise bad(key, value, "a positive number of seconds")

        if self.peer_timeout < 2:
            raise bad("peer_timeout", self.peer_timeout, "at least 2 seconds (a TCP peer pings every second)")

    @property
    def bootstrap_addr(self) -> str:
        return f"{self.host}:{self.bootstrap_port}"
