"""The connector against vLLM's connector interface as other vLLM releases define it, read
from their source (not run): the installed vLLM's and the newest GPU wheel's (0.34.0, fetched
with ``--no-deps`` by ``setup-vllm-cpu.sh`` into the wheel cache, or named by
``KVBRIDGE_VLLM_NEWEST_WHEEL``). vLLM builds a connector loaded by module path as
``cls(vllm_config, role, kv_cache_config)`` and calls its methods by position: every method the
connector defines must keep the base class's parameters, and every abstract one be defined."""

from __future__ import annotations

import ast
import glob
import importlib.util
import os
import zipfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
CONNECTOR = os.path.join(HERE, "..", "src", "kvbridge_vllm", "connector.py")
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
FACTORY = "vllm/distributed/kv_transfer/kv_connector/factory.py"
OUTPUT = "vllm/v1/core/sched/output.py"
# What the connector's scheduler side reads of vLLM's scheduler output (connector._scheduled);
# CachedRequestData.resumed_req_ids is read where it exists (0.32 has it, 0.34 not).
READS = {
    "SchedulerOutput": ["scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens", "preempted_req_ids"],
    "NewRequestData": ["req_id", "block_ids", "num_computed_tokens"],
    "CachedRequestData": ["req_ids", "new_block_ids", "num_computed_tokens"],
}
NEWEST = "0.34.0"


def _newest_wheel():
    named = os.environ.get("KVBRIDGE_VLLM_NEWEST_WHEEL")
    if named:
        return named
    cache = os.environ.get("KVBRIDGE_WHEEL_CACHE") or os.path.expanduser("~/.cache/kvbridge/wheels")
    found = sorted(glob.glob(os.path.join(cache, f"vllm-{NEWEST}-*.whl")))
    return found[0] if found else None


def _sources():
    """(label, base.py text, factory.py text, output.py text) of each vLLM found here."""
    out = []
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.submodule_search_locations:
        root = os.path.dirname(list(spec.submodule_search_locations)[0])
        texts = []
        for name in (BASE, FACTORY, OUTPUT):
            with open(os.path.join(root, name)) as f:
                texts.append(f.read())
        out.append(("installed vLLM", *texts))
    wheel = _newest_wheel()
    if wheel and os.path.exists(wheel):
        with zipfile.ZipFile(wheel) as z:
            out.append((f"vLLM {NEWEST} wheel", *(z.read(n).decode() for n in (BASE, FACTORY, OUTPUT))))
    return out


def missing_fields(output_source: str) -> list:
    """The fields of ``READS`` that the dataclasses of vLLM's ``output.py`` lack."""
    tree = ast.parse(output_source)
    fields = {
        n.name: {a.target.id for a in n.body if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)}
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef)
    }
    return [f"{cls}.{f}" for cls, wanted in READS.items() for f in wanted if f not in fields.get(cls, set())]


def _methods(source: str, class_name: str) -> dict:
    """name -> (positional parameter names, abstract) of a class's methods."""
    tree = ast.parse(source)
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    out = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            names = [a.arg for a in node.args.posonlyargs + node.args.args]
            abstract = any(getattr(d, "id", getattr(d, "attr", None)) == "abstractmethod" for d in node.decorator_list)
            out[node.name] = (names, abstract)
    return out


def mismatches(base_source: str, connector_source: str) -> list:
    """What the connector does that the base class does not take; [] when it fits."""
    base = _methods(base_source, "KVConnectorBase_V1")
    ours = _methods(connector_source, "KvbridgeConnector")
    problems = []
    if base["__init__"][0] != ["self", "vllm_config", "role", "kv_cache_config"]:
        problems.append(f"the base constructor takes {base['__init__'][0]}")
    for name, (params, abstract) in base.items():
        if abstract and name not in ours:
            problems.append(f"abstract method {name} is not defined")
    for name, (params, _) in ours.items():
        if name in base and base[name][0] != params:
            problems.append(f"{name}{tuple(params)} but the base class has {name}{tuple(base[name][0])}")
    return problems


SOURCES = _sources()


@pytest.mark.skipif(not SOURCES, reason=f"no vLLM here and no vLLM {NEWEST} wheel in the wheel cache (setup-vllm-cpu.sh fetches it)")
@pytest.mark.parametrize("label,base,factory,output", SOURCES, ids=[s[0] for s in SOURCES])
def test_the_connector_fits_the_interface(label, base, factory, output):
    with open(CONNECTOR) as f:
        ours = f.read()
    assert mismatches(base, ours) == [], label
    # Loaded by module path, built with the three-argument constructor.
    assert "importlib.import_module(connector_module_path)" in factory
    assert "connector_cls(config, role, kv_cache_config)" in factory
    # The scheduler output the concurrent flow follows has the fields it reads.
    assert missing_fields(output) == [], label


def test_the_comparison_catches_a_changed_signature():
    base = (
        "class KVConnectorBase_V1:\n"
        "    def __init__(self, vllm_config, role, kv_cache_config): ...\n"
        "    @abstractmethod\n    def start_load_kv(self, forward_context, extra): ...\n"
        "    @abstractmethod\n    def save_kv_layer(self, layer_name): ...\n"
    )
    ours = "class KvbridgeConnector:\n    def start_load_kv(self, forward_context): ...\n"
    assert mismatches(base, ours) == [
        "abstract method save_kv_layer is not defined",
        "start_load_kv('self', 'forward_context') but the base class has start_load_kv('self', 'forward_context', 'extra')",
    ]


def test_the_field_check_catches_a_missing_field():
    source = "class SchedulerOutput:\n    scheduled_new_reqs: list\n    num_scheduled_tokens: dict\n"
    assert "SchedulerOutput.preempted_req_ids" in missing_fields(source)
    assert "NewRequestData.block_ids" in missing_fields(source)
