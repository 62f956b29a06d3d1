"""kvbridge's registration field and owner-rule mapping (prefill DCP a -> decode DCP b), on
stand-ins for SGLang's managers: kvbridge's checks refuse with codes and remedies."""

import types

import pytest

from kvbridge_sglang import reshard

pytestmark = pytest.mark.sglang


def manager(tp, dcp, rank=0, mla=True, item_lens=(256, 256), pp=1):
    args = types.SimpleNamespace(page_size=4, kv_item_lens=list(item_lens), num_draft_entries=0,
                                 aux_item_lens=[64], engine_rank=rank)
    return types.SimpleNamespace(kv_args=args, kv_cache_dtype_str="auto", kv_layout=None,
                                 is_mla_backend=mla, is_hybrid_mla_backend=False, attn_tp_size=tp,
                                 attn_cp_size=1, attn_cp_rank=0, pp_size=pp, pp_rank=0, dcp_size=dcp)


def test_the_field_carries_the_dcp_size_and_an_mla_prefills_descriptor():
    field = reshard.registration(manager(tp=2, dcp=2))
    dcp, prefill = reshard.parse_field(field)
    assert dcp == 2 and prefill["role"] == "prefill" and prefill["kv_pool"] == "mla"
    assert reshard.parse_field(reshard.registration(manager(2, 2, mla=False))) == (2, None)
    assert reshard.parse_field(None) is None
    with pytest.raises(ValueError, match="not version 1"):
        reshard.parse_field({"version": 9, "dcp_size": 2})
    with pytest.raises(ValueError, match="dcp_size=0"):
        reshard.parse_field({"version": 1, "dcp_size": 0})


@pytest.mark.parametrize("a,b", [(2, 4), (4, 2), (2, 1), (4, 1), (2, 8), (8, 4)])
def test_each_decode_rank_reads_the_prefill_ranks_owning_its_rows(a, b):
    prefill = reshard.registration(manager(tp=a, dcp=a))["descriptor"]
    for r in range(b):
        m = reshard.owner_rule_mapping(prefill, a, manager(tp=b, dcp=b, rank=r))
        owners = sorted({p % a for p in range(a * b) if p % b == r})
        assert m["target_tp_ranks"] == owners
        assert m["required_prefill_response_num"] == len(owners)
        assert m["target_tp_rank"] == (owners[0] if len(owners) == 1 else None)
        # Every decode rank registering at a prefill rank is counted there.
        readers = sum(1 for d in range(b) if any(p % a == owners[0] and p % b == d for p in range(a * b)))
        assert m["required_dst_info_num"] == readers


def test_kvbridges_check_refuses_with_codes_and_remedies():
    prefill = reshard.registration(manager(tp=2, dcp=2))["descriptor"]
    with pytest.raises(RuntimeError, match=r"kvbridge refuses prefill DCP 2 -> decode DCP 4: KVB-E\d+"):
        reshard.owner_rule_mapping(prefill, 2, manager(tp=4, dcp=4, item_lens=(256,)))
    prefill = reshard.registration(manager(tp=3, dcp=3))["descriptor"]
    with pytest.raises(RuntimeError, match="KVB-E024: attention TP sizes must divide one another.*; choose"):
        reshard.owner_rule_mapping(prefill, 3, manager(tp=2, dcp=2))


def test_a_prefill_without_a_descriptor_is_refused_with_the_fix():
    with pytest.raises(RuntimeError, match="same --dcp-size on both servers"):
        reshard.owner_rule_mapping(None, 2, manager(tp=4, dcp=4))


def test_the_bootstrap_server_publishes_the_field_and_refuses_two_dcp_sizes():
    import requests

    import harness
    from kvbridge_sglang.conn import KvbridgeKVBootstrapServer

    port = harness.free_port()
    server = KvbridgeKVBootstrapServer("127.0.0.1", port)
    url = f"http://127.0.0.1:{port}/route"
    try:
        harness.wait_for(lambda: _up(f"http://127.0.0.1:{port}/health"), "the bootstrap server")
        row = dict(attn_tp_size=2, attn_tp_rank=0, attn_cp_size=1, attn_cp_rank=0, attn_dp_size=1,
                   attn_dp_rank=0, pp_size=1, pp_rank=0, system_dp_size=1, system_dp_rank=0,
                   rank_ip="127.0.0.1", rank_port=1, page_size=4, kv_cache_dtype="auto")
        field = reshard.registration(manager(tp=2, dcp=2))
        assert requests.put(url, json={**row, "kvbridge": field}, timeout=30).status_code == 200
        bad = requests.put(url, json={**row, "attn_tp_rank": 1, "kvbridge": {**field, "dcp_size": 1}}, timeout=30)
        assert bad.status_code == 400 and "different DCP sizes" in bad.text and "(2, then 1)" in bad.text
        assert requests.put(url, json={**row, "attn_tp_rank": 1, "kvbridge": field}, timeout=30).status_code == 200
        query = "?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
        info = requests.get(url + query, timeout=30).json()
        assert info["kvbridge"] == field and info["attn_tp_size"] == 2
        # A rank's own entry stays SGLang's.
        rank = requests.get(url + "?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=1&target_pp_rank=0", timeout=30)
        assert rank.json() == {"rank_ip": "127.0.0.1", "rank_port": 1}
    finally:
        server.close()


def _up(url):
    import requests

    try:
        return requests.get(url, timeout=5).status_code == 200
    except requests.RequestException:
        return False
