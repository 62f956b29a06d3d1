//! Every problem code a planner error names is explained by `kvbridge explain`.

use kvbridge_geometry::GeometryError;
use kvbridge_handshake::explain;

#[test]
fn every_planner_code_is_in_the_catalog() {
    for code in GeometryError::PROBLEM_CODES {
        let info = explain(code).unwrap_or_else(|| panic!("{code} is not in the catalog"));
        assert_eq!(info.id, *code);
    }
}

#[test]
fn a_planner_message_leads_to_its_entry() {
    let e = GeometryError::ChunkStartMisaligned {
        chunk_start: 3,
        page_size: 2,
    }
    .to_string();
    let code = e.rsplit_once('(').unwrap().1.trim_end_matches(')');
    assert_eq!(explain(code).unwrap().id, "KVB-E042");
}
