"""Compatibility checks between a prefill and a decode rank, before any KV moves.

``check(prefill, decode)`` finds every problem at once (the same checks as ``kvbridge check``);
``explain(code)`` says what a problem code means and how to fix it (``kvbridge explain``).
Descriptors are dicts in the descriptor JSON shape (docs/errors.md, "Descriptor format"),
JSON text, or ``PeerDescriptor`` objects.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from kvbridge import _native

__all__ = ["PeerDescriptor", "Problem", "Report", "Explanation", "check", "explain", "problem_codes"]


class PeerDescriptor:
    """What one rank advertises: the descriptor JSON fields as keywords.

    ``PeerDescriptor(role="decode", page_size=64, kv_cache_dtype="auto", kv_pool="mla",
    attn_tp_size=4, attn_tp_rank=1, dcp_size=4, dcp_rank=1, kv_item_lens=[18432] * 61)``

    Validated when built (unknown or missing fields, wrong types and a newer protocol major
    version raise ``ValueError`` naming the field; the fields of a newer minor version that this
    build does not know are left out, and ``check`` warns with ``KVB-W003``); omitted optional
    fields take their defaults, which the attributes show. Immutable; equal when the fields are.
    ``PeerDescriptor.mla(..)`` and ``PeerDescriptor.mha(..)`` build one from the model shape.
    """

    __slots__ = ("_fields",)

    def __init__(self, **fields: Any) -> None:
        self._set(_canonical(json.dumps(fields), "peer"))

    def _set(self, fields: Dict[str, Any]) -> None:
        object.__setattr__(self, "_fields", fields)

    @classmethod
    def from_json(cls, text: Union[str, bytes]) -> "PeerDescriptor":
        """A descriptor from its JSON text."""
        if isinstance(text, bytes):
            text = text.decode()
        out = cls.__new__(cls)
        out._set(_canonical(text, "peer"))
        return out

    @classmethod
    def mla(
        cls,
        role: str,
        page_size: int,
        layers: int,
        token_bytes: int,
        *,
        attn_tp_size: int = 1,
        attn_tp_rank: int = 0,
        dcp_size: int = 1,
        aux_item_lens: Sequence[int] = (),
    ) -> "PeerDescriptor":
        """An MLA rank, as the Rust ``PeerDescriptor::mla`` builds it: ``layers`` KV entries of
        ``page_size * token_bytes`` bytes (``token_bytes``: one token's latent row in one layer,
        576 * 2 for DeepSeek-V3 in bf16), the DCP rank following from the TP rank."""
        return cls.from_json(
            _native.descriptor_mla(
                role, page_size, layers, token_bytes,
                attn_tp_size, attn_tp_rank, dcp_size, list(aux_item_lens),
            )
        )

    @classmethod
    def mha(
        cls,
        role: str,
        page_size: int,
        layers: int,
        total_kv_heads: int,
        head_dim: int,
        *,
        kv_cache_dtype: str = "auto",
        element_bytes: Optional[int] = None,
        attn_tp_size: int = 1,
        attn_tp_rank: int = 0,
        aux_item_lens: Sequence[int] = (),
    ) -> "PeerDescriptor":
        """An MHA/GQA rank, as the Rust ``PeerDescriptor::mha`` builds it: K and V entries per
        layer of ``page_size * heads_per_rank * head_dim * element_bytes`` (the element size
        from ``kv_cache_dtype`` when it names one, else ``element_bytes``)."""
        return cls.from_json(
            _native.descriptor_mha(
                role, page_size, layers, total_kv_heads, head_dim, kv_cache_dtype,
                element_bytes, attn_tp_size, attn_tp_rank, list(aux_item_lens),
            )
        )

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> "PeerDescriptor":
        """A descriptor from a dict in the JSON shape."""
        return cls(**fields)

    def to_dict(self) -> Dict[str, Any]:
        """Every field (defaults included) as a new dict in the JSON shape."""
        return json.loads(json.dumps(self._fields))

    def to_json(self) -> str:
        """The JSON form (what ``from_json`` and ``kvbridge check`` read)."""
        return json.dumps(self._fields, indent=2)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._fields[name]
        except KeyError:
            raise AttributeError(
                f"PeerDescriptor has no field {name!r}; the fields are: {', '.join(self._fields)}"
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("PeerDescriptor is immutable; build a new one with the changed field")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PeerDescriptor) and self._fields == other._fields

    def __hash__(self) -> int:
        return hash(json.dumps(self._fields, sort_keys=True))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._fields.items())
        return f"PeerDescriptor({args})"


def _canonical(text: str, which: str) -> Dict[str, Any]:
    return json.loads(_native.descriptor_json(text, which))


def _as_json(descriptor: Union[PeerDescriptor, Mapping[str, Any], str, bytes], which: str) -> str:
    if isinstance(descriptor, PeerDescriptor):
        return json.dumps(descriptor._fields)
    if isinstance(descriptor, (str, bytes)):
        return descriptor.decode() if isinstance(descriptor, bytes) else descriptor
    if isinstance(descriptor, Mapping):
        return json.dumps(dict(descriptor))
    raise TypeError(
        f"the {which} descriptor must be a PeerDescriptor, a dict in the descriptor JSON shape "
        f"or JSON text, got {type(descriptor).__name__}"
    )


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem: its stable code (``kvbridge.explain(code)``), what is wrong with the values
    seen, and how to fix it."""

    code: str
    severity: str
    message: str
    remedy: str
    values: Dict[str, str]

    def __str__(self) -> str:
        return f"{self.code}: {self.message}; {self.remedy}"


@dataclasses.dataclass(frozen=True)
class Report:
    """Everything ``check`` found. ``compatible`` when ``problems`` is empty (warnings
    allowed); ``mapping`` is then the decode rank's rank mapping (which prefill ranks it
    registers with, how many responses it waits for, the transfer path), else ``None``."""

    compatible: bool
    problems: List[Problem]
    warnings: List[Problem]
    mapping: Optional[Dict[str, Any]]
    compat: str
    prefill_fingerprint: str
    decode_fingerprint: str

    def __bool__(self) -> bool:
        return self.compatible


def _problem(p: Dict[str, Any]) -> Problem:
    return Problem(
        code=p["code"],
        severity=p["severity"],
        message=p["message"],
        remedy=p["remedy"],
        values={field: value for field, value in p["values"]},
    )


def check(
    prefill: Union[PeerDescriptor, Mapping[str, Any], str],
    decode: Union[PeerDescriptor, Mapping[str, Any], str],
    compat: str = "kvbridge",
    *,
    all_cp_ranks_transfer: bool = False,
) -> Report:
    """Every compatibility problem between a prefill and a decode rank, at once.

    ``compat="kvbridge"`` accepts what kvbridge's planner supports (any DCP sizes for MLA,
    different page sizes); ``compat="sglang"`` exactly what SGLang 0.5.23 accepts, refused with
    SGLang's texts. ``all_cp_ranks_transfer``: the decode pulls KV from every prefill CP rank
    (SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER). A descriptor that cannot be read raises
    ``ValueError`` (which side, which field); incompatibility is the report's answer, not an
    exception.
    """
    raw = json.loads(
        _native.check_json(
            _as_json(prefill, "prefill"), _as_json(decode, "decode"), compat, all_cp_ranks_transfer
        )
    )
    return Report(
        compatible=raw["compatible"],
        problems=[_problem(p) for p in raw["problems"]],
        warnings=[_problem(p) for p in raw["warnings"]],
        mapping=raw["mapping"],
        compat=raw["compat"],
        prefill_fingerprint=raw["prefill_fingerprint"],
        decode_fingerprint=raw["decode_fingerprint"],
    )


@dataclasses.dataclass(frozen=True)
class Explanation:
    """A problem code's catalog entry; ``str()`` is the Markdown ``kvbridge explain`` prints."""

    code: str
    title: str
    severity: str
    detected_by: str
    sglang: str
    message: str
    meaning: str
    when: str
    fix: str
    example: str
    markdown: str

    def __str__(self) -> str:
        return self.markdown


def explain(code: str) -> Explanation:
    """What a problem code means, when it happens and how to fix it (``KVB-E007``; ``E007``,
    ``e7`` and ``7`` work too). ``ValueError`` for an unknown code, listing the known ones."""
    return Explanation(**json.loads(_native.explain_json(code)))


def problem_codes() -> List[str]:
    """Every problem code of the catalog, in order."""
    return list(_native.problem_codes())
