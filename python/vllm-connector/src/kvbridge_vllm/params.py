"""What a request carries between the two servers in ``kv_transfer_params``.

Sequential flow: the client (or :mod:`kvbridge_vllm.proxy`) sends the request to the prefill
with ``{"do_remote_decode": true}``; the prefill's response carries
``{"do_remote_prefill": true, "do_remote_decode": false, "kvbridge": {...}}``, which the same
request then takes to the decode. The ``kvbridge`` field says where the KV is (the prefill's
bootstrap address and the request's room) and what it is (tokens, block size, TP size), so
the decode can refuse a pair it cannot serve before it allocates anything.

Concurrent flow: the router picks the room and sends the request to both at once, the prefill
with ``{"do_remote_decode": true, "kvbridge": {"version": 1, "room": R}}`` and the decode with
``{"do_remote_prefill": true, "kvbridge": {"version": 1, "bootstrap_addr": A, "room": R}}``;
the decode loads every prompt token, and kvbridge's opening exchange checks the two servers'
layouts (:func:`concurrent_params`).
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
    #: Prompt tokens the prefill computed; ``None`` in the concurrent flow (every prompt token).
    num_tokens: Optional[int] = None
    block_size: Optional[int] = None
    tp_size: Optional[int] = None

    def to_params(self) -> dict:
        field = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            FIELD: {"version": FIELD_VERSION, **field},
        }

    def tokens(self, num_prompt_tokens: int) -> int:
        """The tokens the decode loads: those the prefill computed, or the whole prompt."""
        return num_prompt_tokens if self.num_tokens is None else self.num_tokens


def concurrent_params(room: int, bootstrap_addr: str) -> tuple:
    """``(to the prefill, to the decode)``: the ``kv_transfer_params`` of one request of the
    concurrent flow, sent to both servers at once."""
    prefill = {"do_remote_decode": True, FIELD: {"version": FIELD_VERSION, "room": room}}
    return prefill, RemoteKv(bootstrap_addr=bootstrap_addr, room=room).to_params()


def requested_room(params: Optional[Mapping[str, Any]]) -> Optional[int]:
    """The room a router chose for a request to the prefill (the concurrent flow), or
    ``None`` (the sequential flow: the prefill picks it). Raises ``ValueError`` naming what is
    wrong."""
    if not wants_remote_decode(params):
        return None
    field = params.get(FIELD)
    if field is None:
        return None
    if not isinstance(field, Mapping) or field.get("version") != FIELD_VERSION:
        raise ValueError(
            f"kv_transfer_params[{FIELD!r}] = {field!r} is not version {FIELD_VERSION}: install "
            "the same kvbridge-vllm on the router, prefill and decode"
        )
    room = field.get("room")
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 2**63:
        raise ValueError(
            f"kv_transfer_params[{FIELD!r}]['room'] = {room!r} is not a room: the router "
            "names one integer in [0, 2^63) for both servers"
        )
    return room


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
    def optional(key: str) -> Optional[int]:
        return None if field.get(key) is None else int(field[key])

    try:
        kv = RemoteKv(
            bootstrap_addr=str(field["bootstrap_addr"]),
            room=int(field["room"]),
            num_tokens=optional("num_tokens"),
            block_size=optional("block_size"),
            tp_size=optional("tp_size"),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"kv_transfer_params[{FIELD!r}] = {dict(field)!r} is malformed: {e}") from None
    sizes = (kv.num_tokens, kv.block_size, kv.tp_size)
    if not 0 <= kv.room < 2**63 or any(v is not None and v < 1 for v in sizes):
        raise ValueError(f"kv_transfer_params[{FIELD!r}] = {dict(field)!r} is out of range")
    return kv
