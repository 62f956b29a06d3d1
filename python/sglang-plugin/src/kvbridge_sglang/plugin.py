"""Registers the transfer backend ``kvbridge`` with SGLang through SGLang's own plugin hooks.

SGLang 0.5.23 has three closed points for transfer backends, each opened here without
editing SGLang's files (docs/sglang.md, "How the plugin hooks in"):

* the CLI choices: ``add_disagg_transfer_backend_choices`` (``sglang.srt.arg_groups.choices``);
* ``TransferBackend`` (``sglang.srt.disaggregation.utils``), a closed ``Enum``: replaced through
  ``HookRegistry`` (REPLACE) by an ``Enum`` with the same members plus ``KVBRIDGE``, which the
  registry also rebinds in every module that imported the old one;
* ``get_kv_class``, a closed if/elif: wrapped through ``HookRegistry`` (AROUND), answering for
  ``kvbridge`` and passing every other backend to SGLang's own function.

The server-argument step ``handle_pd_disaggregation`` refuses decode DCP > 1 for backends it
does not know; :func:`_pd_disaggregation` lifts that for ``kvbridge`` only, after kvbridge's
own checks.
"""

from __future__ import annotations

import enum
import logging
from typing import Any, Callable

from kvbridge_sglang import BACKEND

logger = logging.getLogger(__name__)

_ENUM_TARGET = "sglang.srt.disaggregation.utils.TransferBackend"
_GET_KV_CLASS_TARGET = "sglang.srt.disaggregation.utils.get_kv_class"

_registered = False


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: SGLang calls it once per process, before
    ``HookRegistry.apply_hooks()``. Calling it again does nothing."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    HookRegistry.register(_ENUM_TARGET, _extended_enum(utils.TransferBackend), HookType.REPLACE)
    HookRegistry.register(_GET_KV_CLASS_TARGET, _get_kv_class, HookType.AROUND)
    register_resolution_hook("handle_pd_disaggregation")(_pd_disaggregation)
    _registered = True
    logger.info("kvbridge: transfer backend %r registered", BACKEND)


def _extended_enum(original: type[enum.Enum]) -> type[enum.Enum]:
    """SGLang's ``TransferBackend`` members, in their order, plus ``KVBRIDGE``."""
    if any(m.value == BACKEND for m in original):
        return original
    members = {m.name: m.value for m in original}
    members["KVBRIDGE"] = BACKEND
    extended = enum.Enum(original.__name__, members, module=original.__module__)
    extended.__qualname__ = original.__qualname__
    extended.__doc__ = original.__doc__
    return extended


def kv_classes() -> dict[Any, type]:
    """The four classes for ``KVClassType.MANAGER/SENDER/RECEIVER/BOOTSTRAP_SERVER``."""
    from sglang.srt.disaggregation.utils import KVClassType

    from kvbridge_sglang import conn

    return {
        KVClassType.MANAGER: conn.KvbridgeKVManager,
        KVClassType.SENDER: conn.KvbridgeKVSender,
        KVClassType.RECEIVER: conn.KvbridgeKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: conn.KvbridgeKVBootstrapServer,
    }


def _get_kv_class(original: Callable[..., Any], transfer_backend: Any, class_type: Any) -> Any:
    #= sglang 0.5.23 sglang/srt/disaggregation/utils.py get_kv_class test: test_get_kv_class_returns_the_four_classes, test_every_other_backend_keeps_working
    ## # Every backend shares the same KVArgs container.
    ## if class_type == KVClassType.KVARGS:
    ## return KVArgs
    # KVARGS is shared by every backend: SGLang's function answers it.
    if getattr(transfer_backend, "value", transfer_backend) == BACKEND:
        from sglang.srt.disaggregation.utils import KVClassType

        if class_type != KVClassType.KVARGS:
            return kv_classes().get(class_type)
    return original(transfer_backend, class_type)


def _pd_disaggregation(server_args: Any, previous: Callable[[Any], None]) -> None:
    """SGLang's PD checks, with its decode-DCP refusal lifted for ``kvbridge`` only."""
    if getattr(server_args, "disaggregation_transfer_backend", None) != BACKEND:
        previous(server_args)
        return
    from kvbridge_sglang import checks

    checks.check_server_args(server_args)
    if server_args.disaggregation_mode == "decode" and server_args.dcp_size > 1:
        # The refusal is a list of backend names that relayout DCP pages; kvbridge's
        # classes do (the relayout of SGLang's Mooncake manager, bytes moved by kvbridge's
        # engine), so SGLang's remaining checks run as for that backend, then the name is
        # restored.
        #= sglang 0.5.23 sglang/srt/arg_groups/pd_disaggregation_hook.py handle_pd_disaggregation test: test_decode_dcp_is_lifted_for_kvbridge_only
        ## if cfg.disaggregation_transfer_backend not in (
        ## "mooncake",
        server_args.disaggregation_transfer_backend = "mooncake"
        try:
            previous(server_args)
        finally:
            server_args.disaggregation_transfer_backend = BACKEND
        return
    previous(server_args)
