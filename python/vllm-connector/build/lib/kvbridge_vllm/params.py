"""What a request carries between the two servers in ``kv_transfer_params``.

The client (or :mod:`kvbridge_vllm.proxy`) sends the request to the prefill with
``{"do_remote_decode": true}``; the prefill's response carries
``{"do_remote_prefill": true, "do_remote_decode": false, "kvbridge": {...}}``, which the same
request then takes to the decode. The ``kvbridge`` field says where the KV is (the prefill's
bootstrap address and the request's room) and what it is (tokens, block size, TP size), so
the decode can refuse a pair it cannot serve before it allocates anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

FIELD = "kvbridge"
# Bumped when the field's meaning changes; a decode refuses a version it does not know.
FIELD_VERSION = 1


@dataclasses.dataclass(frozen=True)
class RemoteKv:
    """Where a request's KV waits on its prefill, as the decode reads it."""

    bootstrap_addr: str
    room: int
    num_tokens: int
    block_size: int
    tp_size: int

    def to_params(self) -> dict:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            FIELD: {"version": FIELD_VERSION, **dataclasses.asdict(self)},
        }


def wants_remote_decode(params: Optional[Mapping[str, Any]]) -> bool:
    """Whether a request to the prefill asks for its KV to be kept for a decode."""
    return bool(params) and bool(params.get("do_remote_decode"))


def remote_kv(params: Optional[Mapping[str, Any]]) -> Optional[RemoteKv]:
    """The KV a request to the decode should load, or ``None`` (a plain request, or one whose
    transfer already started). Raises ``ValueError`` naming what is wrong with a field this
    version cannot read."""
    if not params or not params.get("do_remote_prefill"):
        return None
    field = params.get(FIELD)
    if not isinstance(field, Mapping):
        raise ValueError(
            f"kv_transfer_params asks for a remote prefill but carries no {FIELD!r} field "
            f"(got keys {sorted(params)}): send the request to a prefill running "
            "KvbridgeConnector first and pass its response's kv_transfer_params on unchanged"
        )
    if field.get("version") != FIELD_VERSION:
        raise ValueError(
            f"kv_transfer_params[{FIELD!r}] has version {field.get('version')!r}, this "
            f"KvbridgeConnector reads version {FIELD_VERSION}: install the same kvbridge-vllm "
            "on prefill and decode"
        )
    try:
        kv = RemoteKv(
            bootstrap_addr=str(field["bootstrap_addr"]),
            room=int(field["room"]),
            num_tokens=int(field["num_tokens"]),
            block_size=int(field["block_size"]),
            tp_size=int(field["tp_size"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"kv_transfer_params[{FIELD!r}] = {dict(field)!r} is malformed: {e}") from None
    if not 0 <= kv.room < 2**63 or kv.num_tokens < 1 or kv.block_size < 1 or kv.tp_size < 1:
        raise ValueError(f"kv_transfer_params[{FIELD!r}] = {dict(field)!r} is out of range")
    return kv
