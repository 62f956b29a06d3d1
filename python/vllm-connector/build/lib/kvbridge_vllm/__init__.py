"""kvbridge as a vLLM KV connector: ``"kv_connector": "KvbridgeConnector",
"kv_connector_module_path": "kvbridge_vllm.connector"`` (docs/vllm.md).

The connector runs kvbridge's coordinator (``kvbridge.PrefillAgent`` / ``DecodeAgent``: a
bootstrap server, rooms, deadlines, fencing, abort acknowledgement) under vLLM's
``KVConnectorBase_V1``; :mod:`kvbridge_vllm.proxy` is the small router that takes a request to
the prefill and then to the decode.
"""

CONNECTOR = "KvbridgeConnector"
MODULE = "kvbridge_vllm.connector"

__all__ = ["CONNECTOR", "MODULE"]
