"""SGLang's KV checksum (``--disaggregation-enable-kv-checksum``) on kvbridge's manager: the
decode compares the prefill's digest only where it covers the bytes this rank holds
(``should_verify_kv_checksum``), answered per prefill from its published geometry. The digest
computer itself runs on CUDA only; these are the manager's answers, geometry by geometry."""

import types

import pytest

from kvbridge_sglang import reshard

pytestmark = pytest.mark.sglang


def _published(tp, dcp, mla):
    """What a kvbridge prefill of this geometry publishes in its bootstrap registration."""
    args = types.SimpleNamespace(page_size=4, kv_item_lens=[256, 256], num_draft_entries=0,
                                 aux_item_lens=[64], engine_rank=0)
    mgr = types.SimpleNamespace(kv_args=args, kv_cache_dtype_str="auto", kv_layout=None,
                                is_mla_backend=mla, is_hybrid_mla_backend=False, attn_tp_size=tp,
                                attn_cp_size=1, attn_cp_rank=0, pp_size=1, pp_rank=0, dcp_size=dcp)
    return reshard.registration(mgr)


def _decode_manager(tp, dcp, mla, prefills):
    from kvbridge_sglang.conn import KvbridgeKVManager, _PrefillServerInfo

    # SGLang's __init__ opens sockets and starts threads; the answer reads only these fields.
    mgr = object.__new__(KvbridgeKVManager)
    mgr.dcp_size, mgr.attn_tp_size = dcp, tp
    mgr.is_mla_backend, mgr.is_hybrid_mla_backend = mla, False
    mgr.prefill_info_table = {
        addr: _PrefillServerInfo(attn_tp_size=p_tp, attn_cp_size=1, dp_size=1, pp_size=1,
                                 page_size=4, kv_cache_dtype="auto", follow_bootstrap_room=True,
                                 kvbridge=field)
        for addr, (p_tp, field) in prefills.items()
    }
    return mgr


# (prefill TP, prefill DCP) -> (decode TP, decode DCP), pool, whether the digest compares.
GEOMETRIES = [
    ((1, 1), (1, 1), "mla", True),
    ((2, 2), (2, 2), "mla", True),
    ((1, 1), (2, 1), "mla", True),  # MLA's latent is whole on every TP rank
    ((1, 1), (4, 4), "mla", False),  # DCP 1 -> 4: each decode rank holds a quarter of the tokens
    ((2, 2), (4, 4), "mla", False),
    ((4, 4), (1, 1), "mla", False),
    ((2, 2), (8, 8), "mla", False),
    ((4, 4), (2, 2), "mla", False),
    ((2, 1), (2, 1), "mha", True),
    ((1, 1), (2, 1), "mha", False),  # each decode rank holds half of the heads
    ((2, 1), (1, 1), "mha", False),
]


@pytest.mark.parametrize("prefill,decode,pool,compares", GEOMETRIES)
def test_the_checksum_is_verified_only_where_the_digest_covers_this_ranks_bytes(
    prefill, decode, pool, compares
):
    mla = pool == "mla"
    mgr = _decode_manager(*decode, mla, {"10.0.0.1:8998": (prefill[0], _published(*prefill, mla))})
    assert mgr.should_verify_kv_checksum("10.0.0.1:8998") is compares


def test_the_answer_is_per_prefill():
    mgr = _decode_manager(4, 4, True, {
        "p1:8998": (1, _published(1, 1, True)),
        "p4:8998": (4, _published(4, 4, True)),
        "other-backend:8998": (4, None),  # no kvbridge field: a DCP 1 prefill
    })
    assert mgr.should_verify_kv_checksum("p1:8998") is False
    assert mgr.should_verify_kv_checksum("p4:8998") is True
    assert mgr.should_verify_kv_checksum("other-backend:8998") is False
    # A prefill whose parallel info is not known yet: SGLang's own answer.
    assert mgr.should_verify_kv_checksum("unknown:8998") is True
    # A field this version cannot read compares nothing.
    mgr.prefill_info_table["p4:8998"].kvbridge = {"version": 9}
    assert mgr.should_verify_kv_checksum("p4:8998") is False
