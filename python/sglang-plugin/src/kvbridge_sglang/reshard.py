"""Prefill DCP a -> decode DCP b: kvbridge's registration field and rank mapping.

SGLang 0.5.23 maps a decode attention-TP rank to prefill ranks by TP sizes alone
(``CommonKVManager._resolve_rank_mapping``) and its bootstrap server does not publish the
prefill's DCP size, so its DCP relayout covers prefill DCP 1 only. A kvbridge prefill rank adds
a field (:data:`FIELD`) to its bootstrap registration: its DCP size and, for an MLA pool, its
``kvbridge.PeerDescriptor`` (sizes and ranks of its pool). A decode facing a prefill DCP > 1
runs ``kvbridge.check`` on the two descriptors (every problem, with codes and remedies) and
takes its rank mapping, the owner rule: position ``p`` lives on prefill DCP rank ``p mod a``
and is needed by decode DCP rank ``p mod b`` (docs/sglang.md, "DCP a -> b";
docs/planning.md).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

import kvbridge

# The key of kvbridge's field in a prefill rank's bootstrap registration (``PUT /route``) and
# in the bootstrap server's parallel info (``GET /route`` with every rank -1).
FIELD = "kvbridge"
# Bumped when the field's meaning changes; a decode refuses a version it does not know.
FIELD_VERSION = 1


def pool_kind(mgr: Any) -> str:
    if getattr(mgr, "is_hybrid_mla_backend", False):
        return "hybrid_mla"
    return "mla" if mgr.is_mla_backend else "mha"


def descriptor(mgr: Any, role: str, tp_rank: int = 0) -> dict:
    """The ``PeerDescriptor`` fields of an MLA manager's rank (docs/errors.md, "Descriptor
    format"), from what SGLang's manager holds."""
    args = mgr.kv_args
    return {
        "role": role,
        "page_size": int(args.page_size),
        "kv_cache_dtype": str(mgr.kv_cache_dtype_str or "auto"),
        "kv_layout": mgr.kv_layout,
        "kv_pool": pool_kind(mgr),
        "attn_tp_size": int(mgr.attn_tp_size),
        "attn_tp_rank": int(tp_rank),
        "attn_cp_size": int(mgr.attn_cp_size),
        "attn_cp_rank": int(mgr.attn_cp_rank),
        "pp_size": int(mgr.pp_size),
        "pp_rank": int(mgr.pp_rank or 0),
        "dcp_size": int(mgr.dcp_size),
        "dcp_rank": int(tp_rank) % int(mgr.dcp_size),
        "kv_cache_sharding": int(getattr(mgr, "kv_shard_size", 1)) > 1,
        "kv_item_lens": [int(n) for n in args.kv_item_lens],
        "num_draft_entries": int(args.num_draft_entries or 0),
        "aux_item_lens": [int(n) for n in args.aux_item_lens],
    }


def registration(mgr: Any) -> dict:
    """The field a kvbridge prefill rank adds to its bootstrap registration: the same on every
    rank of one prefill server (ranks are left at 0). The descriptor is left out where the
    decode cannot reshard (an MHA pool, pipeline stages with different layers)."""
    reshardable = pool_kind(mgr) == "mla" and mgr.pp_size == 1
    prefill = descriptor(mgr, "prefill") if reshardable else None
    return {"version": FIELD_VERSION, "dcp_size": int(mgr.dcp_size), "descriptor": prefill}


def parse_field(field: Any) -> Optional[Tuple[int, Optional[dict]]]:
    """``(dcp_size, descriptor)`` from a published field; ``None`` when there is none (a prefill
    without kvbridge's field). Raises ``ValueError`` for a field this version cannot read."""
    if field is None:
        return None
    if not isinstance(field, Mapping) or field.get("version") != FIELD_VERSION:
        raise ValueError(
            f"the prefill's bootstrap field {FIELD!r} is {field!r}, not version {FIELD_VERSION} "
            "of kvbridge-sglang; install the same kvbridge-sglang on prefill and decode"
        )
    dcp = field.get("dcp_size")
    if not isinstance(dcp, int) or isinstance(dcp, bool) or dcp < 1:
        raise ValueError(
            f"the prefill's bootstrap field {FIELD!r} has dcp_size={dcp!r}; it must be a "
            "positive integer (the prefill's --dcp-size)"
        )
    prefill = field.get("descriptor")
    if prefill is not None and not isinstance(prefill, Mapping):
        raise ValueError(
            f"the prefill's bootstrap field {FIELD!r} has descriptor={prefill!r}; it must be a "
            "PeerDescriptor's fields or null"
        )
    return dcp, prefill


def owner_rule_mapping(prefill: Optional[Mapping], prefill_dcp: int, decode_mgr: Any) -> dict:
    """``kvbridge.check``'s rank mapping of the decode manager's rank against the prefill.

    Raises ``RuntimeError`` (SGLang's type for topology refusals at bootstrap) with every
    problem ``check`` found, each with its code and remedy.
    """
    b = decode_mgr.dcp_size
    if prefill is None:
        raise RuntimeError(
            f"prefill DCP {prefill_dcp} -> decode DCP {b}: the prefill publishes no kvbridge "
            "descriptor, which it does for an MLA pool without pipeline stages only; resharding "
            "moves token rows between DCP ranks, which needs one latent vector per token: use "
            "the same --dcp-size on both servers for this model, or --pp-size 1 on the prefill"
        )
    tp_rank = decode_mgr.kv_args.engine_rank % decode_mgr.attn_tp_size
    report = kvbridge.check(prefill, descriptor(decode_mgr, "decode", tp_rank))
    if not report.compatible:
        problems = "; ".join(str(p) for p in report.problems)
        raise RuntimeError(f"kvbridge refuses prefill DCP {prefill_dcp} -> decode DCP {b}: {problems}")
    mapping = dict(report.mapping)
    # SGLang's receiver marks a peer dummy unless it is target_tp_rank (None: every peer real)
    # and sends one required_dst_info_num to every peer: the mapping must fit both.
    peers = mapping["peers"]
    real = [p["tp_rank"] for p in peers if not p["is_dummy"]]
    counts = {p["required_dst_info_num"] for p in peers}
    if (len(real) > 1 and len(real) < len(peers)) or len(counts) != 1:
        raise RuntimeError(
            f"prefill DCP {prefill_dcp} (attention TP {prefill['attn_tp_size']}) -> decode DCP "
            f"{b} (attention TP {decode_mgr.attn_tp_size}) needs per-peer dummy flags or "
            "registration counts that SGLang's receiver cannot carry; make the decode's "
            "attention TP size a multiple of the prefill's"
        )
    mapping["target_tp_rank"] = real[0] if len(real) == 1 else None
    mapping["required_dst_info_num"] = counts.pop()
    return mapping


def digest_covers_this_rank(info: Any, decode_mgr: Any) -> bool:
    """Whether the KV checksum that the prefill of ``info`` (its ``PrefillServerInfo``) sends
    digests the bytes this decode rank holds, as SGLang's ``--disaggregation-enable-kv-checksum``
    compares it. Not where kvbridge relayouts rows between DCP sizes (prefill DCP a -> decode
    DCP b, a != b, prefill DCP 1 included: each decode rank holds other tokens than the prefill
    digested), nor where a decode rank receives a slice of the heads (an MHA/GQA pool under
    another attention TP size). A field this version cannot read digests nothing comparable."""
    try:
        field = parse_field(getattr(info, FIELD, None))
    except ValueError:
        return False
    prefill_dcp = 1 if field is None else field[0]
    if prefill_dcp != decode_mgr.dcp_size:
        return False
    latent = decode_mgr.is_mla_backend or getattr(decode_mgr, "is_hybrid_mla_backend", False)
    return latent or info.attn_tp_size == decode_mgr.attn_tp_size
