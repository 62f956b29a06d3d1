//! The checks: `kvbridge.check`, `kvbridge.explain` and descriptor validation over
//! `kvbridge-handshake`, the same functions `kvbridge check` and `kvbridge explain` use.
//!
//! Descriptors and reports cross as JSON text (the descriptor JSON shape is the public contract
//! of `PeerDescriptor`); the Python layer (`kvbridge/checks.py`) turns them into objects.

use kvbridge_handshake::{
    CheckOptions, Compat, HandshakeError, PeerDescriptor, PeerDescriptorBuilder, Role, catalog,
    check_with, explain,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use serde_json::{Value, json};

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(descriptor_json, m)?)?;
    m.add_function(wrap_pyfunction!(descriptor_mla, m)?)?;
    m.add_function(wrap_pyfunction!(descriptor_mha, m)?)?;
    m.add_function(wrap_pyfunction!(check_json, m)?)?;
    m.add_function(wrap_pyfunction!(explain_json, m)?)?;
    m.add_function(wrap_pyfunction!(problem_codes, m)?)?;
    Ok(())
}

fn parse(text: &str, which: &str) -> PyResult<PeerDescriptor> {
    let d = PeerDescriptor::from_json(text).map_err(|e| describe(&e, which))?;
    d.ensure_supported_version()
        .map_err(|e| describe(&e, which))?;
    Ok(d)
}

fn describe(e: &HandshakeError, which: &str) -> PyErr {
    PyValueError::new_err(format!("the {which} descriptor: {e}"))
}

/// The descriptor in its canonical JSON form (every default filled in), or a `ValueError`
/// saying which field is wrong and how to fix it.
#[pyfunction]
fn descriptor_json(text: &str, which: &str) -> PyResult<String> {
    Ok(parse(text, which)?.to_json_pretty())
}

fn role(text: &str) -> PyResult<Role> {
    text.parse().map_err(PyValueError::new_err)
}

/// The parallelism and aux buffers both shapes take, then the descriptor as canonical JSON.
fn finish(
    b: PeerDescriptorBuilder,
    attn_tp: (u32, u32),
    dcp_size: u32,
    aux_item_lens: Vec<u64>,
) -> PyResult<String> {
    b.attn_tp(attn_tp.0, attn_tp.1)
        .dcp(dcp_size)
        .aux_item_lens(aux_item_lens)
        .build()
        .map(|d| d.to_json_pretty())
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// `PeerDescriptor::mla` (`layers` entries of `page_size · token_bytes`), as canonical JSON.
#[pyfunction]
#[pyo3(signature = (role, page_size, layers, token_bytes, attn_tp_size=1, attn_tp_rank=0, dcp_size=1, aux_item_lens=Vec::new()))]
#[allow(clippy::too_many_arguments)]
fn descriptor_mla(
    role: &str,
    page_size: u64,
    layers: usize,
    token_bytes: u64,
    attn_tp_size: u32,
    attn_tp_rank: u32,
    dcp_size: u32,
    aux_item_lens: Vec<u64>,
) -> PyResult<String> {
    let b = PeerDescriptor::mla(self::role(role)?, page_size, layers, token_bytes);
    finish(b, (attn_tp_size, attn_tp_rank), dcp_size, aux_item_lens)
}

/// `PeerDescriptor::mha` (K and V entries per layer, heads sharded over attention TP), as
/// canonical JSON.
#[pyfunction]
#[pyo3(signature = (role, page_size, layers, total_kv_heads, head_dim, kv_cache_dtype="auto", element_bytes=None, attn_tp_size=1, attn_tp_rank=0, aux_item_lens=Vec::new()))]
#[allow(clippy::too_many_arguments)]
fn descriptor_mha(
    role: &str,
    page_size: u64,
    layers: usize,
    total_kv_heads: u32,
    head_dim: u32,
    kv_cache_dtype: &str,
    element_bytes: Option<u64>,
    attn_tp_size: u32,
    attn_tp_rank: u32,
    aux_item_lens: Vec<u64>,
) -> PyResult<String> {
    let mut b = PeerDescriptor::mha(
        self::role(role)?,
        page_size,
        layers,
        total_kv_heads,
        head_dim,
    )
    .kv_cache_dtype(kv_cache_dtype);
    if let Some(n) = element_bytes {
        b = b.element_bytes(n);
    }
    finish(b, (attn_tp_size, attn_tp_rank), 1, aux_item_lens)
}

/// Every problem between two descriptors at once, with the decode rank's mapping when there
/// are none: `{"compatible", "problems", "warnings", "mapping", "compat", fingerprints}`.
#[pyfunction]
#[pyo3(signature = (prefill, decode, compat, all_cp_ranks=false))]
fn check_json(prefill: &str, decode: &str, compat: &str, all_cp_ranks: bool) -> PyResult<String> {
    let compat = match compat {
        "kvbridge" => Compat::Kvbridge,
        "sglang" => Compat::Sglang,
        other => {
            return Err(PyValueError::new_err(format!(
                "compat must be \"kvbridge\" (what kvbridge's planner supports) or \"sglang\" \
                 (exactly what SGLang 0.5.23 accepts), got {other:?}"
            )));
        }
    };
    let (prefill, decode) = (parse(prefill, "prefill")?, parse(decode, "decode")?);
    let options = CheckOptions::new(compat).with_all_cp_ranks_transfer(all_cp_ranks);
    let report = check_with(&prefill, &decode, &options);
    let mapping = match &report.mapping {
        Some(m) => serde_json::to_value(m).map_err(|e| PyValueError::new_err(e.to_string()))?,
        None => Value::Null,
    };
    Ok(json!({
        "compatible": report.is_compatible(),
        "problems": report.problems,
        "warnings": report.warnings,
        "mapping": mapping,
        "compat": compat.as_str(),
        "prefill_fingerprint": report.prefill_fingerprint.to_string(),
        "decode_fingerprint": report.decode_fingerprint.to_string(),
    })
    .to_string())
}

/// The catalog entry of a problem code (`KVB-E007`, `E007`, `e7` and `7` all work), with its
/// Markdown text as `kvbridge explain` prints it; a `ValueError` listing the known codes for an
/// unknown one.
#[pyfunction]
fn explain_json(code: &str) -> PyResult<String> {
    let Some(info) = explain(code) else {
        let known: Vec<&str> = catalog().iter().map(|i| i.id).collect();
        return Err(PyValueError::new_err(format!(
            "unknown problem code {code:?}; known codes: {}",
            known.join(", ")
        )));
    };
    Ok(json!({
        "code": info.id,
        "title": info.title,
        "severity": info.severity,
        "detected_by": info.detected_by,
        "sglang": info.sglang,
        "message": info.message,
        "meaning": info.meaning,
        "when": info.when,
        "fix": info.fix,
        "example": info.example,
        "markdown": info.to_markdown(),
    })
    .to_string())
}

/// Every problem code of the catalog, in order.
#[pyfunction]
fn problem_codes() -> Vec<&'static str> {
    catalog().iter().map(|i| i.id).collect()
}
