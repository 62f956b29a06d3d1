"""kvbridge.check / explain against the example descriptor pairs of examples/descriptors."""

import json
import pathlib

import pytest

import kvbridge
from kvbridge import PeerDescriptor

EXAMPLES = pathlib.Path(__file__).resolve().parents[3] / "examples" / "descriptors"


def load(name, side):
    return json.loads((EXAMPLES / name / f"{side}.json").read_text())


def test_every_problem_is_reported_at_once_with_code_message_remedy_values():
    report = kvbridge.check(load("three-problems", "prefill"), load("three-problems", "decode"))
    assert not report.compatible and not report
    assert [p.code for p in report.problems] == ["KVB-E002", "KVB-E024", "KVB-E012"]
    for p in report.problems:
        assert p.message and p.remedy and p.severity == "error"
        assert p.code in str(p) and p.remedy in str(p)
    dtype = report.problems[0]
    assert "fp8_e4m3" in dtype.message
    assert dtype.values == {"prefill.kv_cache_dtype": "fp8_e4m3", "decode.kv_cache_dtype": "auto"}
    assert report.mapping is None


def test_a_compatible_pair_comes_with_its_rank_mapping():
    report = kvbridge.check(load("deepseek-mla-dcp4", "prefill"), load("deepseek-mla-dcp4", "decode"))
    assert report.compatible and report.problems == []
    m = report.mapping
    assert m["decode_dcp_size"] == 4 and m["decode_virtual_page_size"] == 64 * 4
    assert m["required_prefill_response_num"] >= 1 and m["peers"]


def test_compat_sglang_applies_sglangs_rules():
    pre, dec = load("mla-page16-to-page64", "prefill"), load("mla-page16-to-page64", "decode")
    assert kvbridge.check(pre, dec).compatible
    strict = kvbridge.check(pre, dec, compat="sglang")
    assert [p.code for p in strict.problems] == ["KVB-E001"] and strict.compat == "sglang"
    pre, dec = load("mla-dcp2-to-dcp4", "prefill"), load("mla-dcp2-to-dcp4", "decode")
    assert kvbridge.check(pre, dec, "kvbridge").compatible
    strict = kvbridge.check(pre, dec, "sglang")
    assert any("Unsupported PD DCP topology: 2 -> 4" in p.message for p in strict.problems)


def test_descriptor_objects_dicts_and_json_text_are_the_same_input():
    pre, dec = load("three-problems", "prefill"), load("three-problems", "decode")
    as_dicts = kvbridge.check(pre, dec)
    as_objects = kvbridge.check(PeerDescriptor(**pre), PeerDescriptor.from_dict(dec))
    as_text = kvbridge.check(json.dumps(pre), (EXAMPLES / "three-problems" / "decode.json").read_text())
    assert as_dicts == as_objects == as_text


def test_descriptor_keywords_fill_defaults_and_refuse_typos():
    d = PeerDescriptor(
        role="decode", page_size=64, kv_cache_dtype="auto", kv_pool="mla",
        attn_tp_size=4, attn_tp_rank=1, dcp_size=4, dcp_rank=1, kv_item_lens=[18432, 18432],
    )
    assert d.pp_size == 1 and d.num_draft_entries == 0 and d.protocol_version == "1.0"
    assert PeerDescriptor.from_json(d.to_json()) == d
    assert d.to_dict()["kv_item_lens"] == [18432, 18432]
    with pytest.raises(AttributeError, match="immutable"):
        d.page_size = 16
    with pytest.raises(ValueError, match=r"unknown field `page_sise`"):
        PeerDescriptor(role="decode", page_sise=64)
    with pytest.raises(ValueError, match=r"missing field `page_size`"):
        PeerDescriptor(role="decode")
    with pytest.raises(ValueError, match=r"the prefill descriptor: .*unknown variant `teacher`"):
        kvbridge.check({"role": "teacher"}, d)


def test_the_builders_make_the_descriptor_the_keywords_spell_out():
    spelled = PeerDescriptor(
        role="decode", page_size=64, kv_cache_dtype="auto", kv_pool="mla",
        attn_tp_size=4, attn_tp_rank=1, dcp_size=4, dcp_rank=1, kv_item_lens=[18432, 18432],
    )
    assert PeerDescriptor.mla("decode", 64, 2, 288, attn_tp_size=4, attn_tp_rank=1, dcp_size=4) == spelled
    gqa = PeerDescriptor.mha("prefill", 64, 2, 8, 128, kv_cache_dtype="bfloat16", attn_tp_size=4)
    assert gqa.kv_item_lens == [64 * 2 * 128 * 2] * 4
    assert (gqa.total_kv_heads, gqa.head_dim) == (8, 128)
    with pytest.raises(ValueError, match="dcp_size 3 does not divide attn_tp_size 4"):
        PeerDescriptor.mla("decode", 64, 2, 288, attn_tp_size=4, dcp_size=3)


def test_fields_of_a_newer_minor_version_are_a_warning():
    pre = load("deepseek-mla-dcp4", "prefill")
    pre.update(protocol_version="1.3", kv_zones=4)
    report = kvbridge.check(pre, load("deepseek-mla-dcp4", "decode"))
    assert report.compatible
    assert [w.code for w in report.warnings] == ["KVB-W003"]


def test_a_newer_protocol_major_is_refused():
    pre = load("three-problems", "prefill")
    pre["protocol_version"] = "2.0"
    with pytest.raises(ValueError, match="upgrade kvbridge"):
        kvbridge.check(pre, load("three-problems", "decode"))


def test_bad_arguments_are_refused_with_the_choices():
    pre, dec = load("three-problems", "prefill"), load("three-problems", "decode")
    with pytest.raises(ValueError, match=r'compat must be "kvbridge" .* or "sglang"'):
        kvbridge.check(pre, dec, compat="vllm")
    with pytest.raises(TypeError, match="the decode descriptor must be"):
        kvbridge.check(pre, 42)


def test_explain_gives_the_catalog_entry_of_any_spelling():
    e = kvbridge.explain("KVB-E040")
    assert e.code == "KVB-E040" and "decode_prefix_len" in e.message and "round" in e.fix.lower()
    assert kvbridge.explain("e40") == kvbridge.explain("40") == e
    assert str(e).startswith("## KVB-E040")
    codes = kvbridge.problem_codes()
    assert "KVB-E002" in codes and all(kvbridge.explain(c).code == c for c in codes)
    with pytest.raises(ValueError, match='unknown problem code "KVB-E999"; known codes: KVB-E001, '):
        kvbridge.explain("KVB-E999")


def test_every_reported_code_is_explained():
    for name in sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir()):
        for compat in ["kvbridge", "sglang"]:
            report = kvbridge.check(load(name, "prefill"), load(name, "decode"), compat)
            for p in report.problems + report.warnings:
                assert kvbridge.explain(p.code).severity == p.severity
