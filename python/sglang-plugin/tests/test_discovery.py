"""SGLang finds the backend through its entry point, and every other backend still works."""

import pytest

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def loaded():
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.disaggregation import utils

    return utils


def test_the_entry_point_is_in_sglangs_group():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("kvbridge") == "kvbridge_sglang.plugin:register"


def test_get_kv_class_returns_the_four_classes(loaded):
    from kvbridge_sglang import conn

    backend = loaded.TransferBackend("kvbridge")
    assert backend.name == "KVBRIDGE"
    want = {
        loaded.KVClassType.MANAGER: conn.KvbridgeKVManager,
        loaded.KVClassType.SENDER: conn.KvbridgeKVSender,
        loaded.KVClassType.RECEIVER: conn.KvbridgeKVReceiver,
        loaded.KVClassType.BOOTSTRAP_SERVER: conn.KvbridgeKVBootstrapServer,
    }
    for class_type, cls in want.items():
        assert loaded.get_kv_class(backend, class_type) is cls
    from sglang.srt.disaggregation.base import KVArgs

    assert loaded.get_kv_class(backend, loaded.KVClassType.KVARGS) is KVArgs


def test_every_other_backend_keeps_working(loaded):
    from sglang.srt.disaggregation.fake import FakeKVManager
    from sglang.srt.disaggregation.mooncake import MooncakeKVManager, MooncakeKVSender

    names = [m.value for m in loaded.TransferBackend]
    assert names[:5] == ["mooncake", "mori", "nixl", "ascend", "fake"] and names[-1] == "kvbridge"
    m = loaded.KVClassType
    assert loaded.get_kv_class(loaded.TransferBackend("mooncake"), m.MANAGER) is MooncakeKVManager
    assert loaded.get_kv_class(loaded.TransferBackend.MOONCAKE, m.SENDER) is MooncakeKVSender
    assert loaded.get_kv_class(loaded.TransferBackend.FAKE, m.MANAGER) is FakeKVManager
    with pytest.raises(ValueError):
        loaded.TransferBackend("nope")


def test_modules_that_imported_the_enum_see_the_new_one(loaded):
    # HookRegistry rebinds `from ... import TransferBackend` in modules already imported.
    from sglang.srt.disaggregation import decode, prefill

    assert decode.TransferBackend is loaded.TransferBackend
    assert prefill.TransferBackend is loaded.TransferBackend
    assert decode.get_kv_class is loaded.get_kv_class


def test_the_cli_accepts_the_flag(loaded):
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(
        ["--model-path", "dummy", "--disaggregation-transfer-backend", "kvbridge"]
    )
    assert args.disaggregation_transfer_backend == "kvbridge"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "dummy", "--disaggregation-transfer-backend", "nope"])


def test_registering_twice_changes_nothing(loaded):
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES

    from kvbridge_sglang.plugin import register

    register()
    assert DISAGG_TRANSFER_BACKEND_CHOICES.count("kvbridge") == 1


def _decode_dcp4(backend):
    from sglang.srt.arg_groups.pd_disaggregation_hook import handle_pd_disaggregation
    from sglang.srt.arg_groups.resolution_hooks import run_hook
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path="dummy",
        device="cpu",
        disaggregation_mode="decode",
        dcp_size=4,
        tp_size=4,
        disaggregation_transfer_backend=backend,
    )
    run_hook(handle_pd_disaggregation, args)
    return args


def test_decode_dcp_is_lifted_for_kvbridge_only(loaded):
    assert _decode_dcp4("kvbridge").disaggregation_transfer_backend == "kvbridge"
    # SGLang's refusal stays for every backend it does not know.
    with pytest.raises(ValueError, match="PD decode DCP requires"):
        _decode_dcp4("not-a-backend")


def test_kvbridges_own_checks_run_instead(loaded, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_SGLANG_TRANSPORT", "carrier-pigeon")
    with pytest.raises(ValueError, match="KVBRIDGE_SGLANG_TRANSPORT='carrier-pigeon'.*tcp"):
        _decode_dcp4("kvbridge")
    monkeypatch.delenv("KVBRIDGE_SGLANG_TRANSPORT")
    monkeypatch.setenv("SGLANG_DISAGG_STAGING_BUFFER", "1")
    with pytest.raises(ValueError, match="no staging buffers"):
        _decode_dcp4("kvbridge")
