//! The seeded JSON mutator of the CLI fuzz tests (`plan.rs`, `check.rs`).

use kvbridge_conformance::SplitMix64;
use serde_json::{Value, json};

/// One mutation of a JSON object: one of `fields` set to an extreme (integer edges, negative,
/// float, wrong types, an array longer than any maximum), an element of one of `lists` set to
/// an extreme, a bit flip, or a truncation. Accepted values stay small, so every run is quick
/// by construction.
pub(crate) fn mutate(text: &str, fields: &[&str], lists: &[&str], rng: &mut SplitMix64) -> String {
    let extremes = [
        json!(0),
        json!(1),
        json!(1025),
        json!((1u64 << 20) + 1),
        json!(1u64 << 31),
        json!(u32::MAX),
        json!(1u64 << 32),
        json!(1u64 << 62),
        json!(u64::MAX),
        json!(-1),
        json!(1.5),
        json!("8"),
        Value::Null,
        json!([]),
        json!((0..5000).collect::<Vec<u64>>()),
        json!([u64::MAX, 0]),
    ];
    match rng.index(4) {
        0 | 1 => match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(mut o)) => {
                let v = extremes[rng.index(extremes.len())].clone();
                if rng.index(2) == 0 {
                    o.insert(fields[rng.index(fields.len())].to_owned(), v);
                } else if let Some(Value::Array(items)) = o.get_mut(lists[rng.index(lists.len())]) {
                    if !items.is_empty() {
                        let i = rng.index(items.len());
                        items[i] = v;
                    }
                }
                Value::Object(o).to_string()
            }
            _ => text.to_owned(),
        },
        2 => {
            let mut bytes = text.as_bytes().to_vec();
            if !bytes.is_empty() {
                let i = rng.index(bytes.len());
                bytes[i] ^= 1 << rng.index(8);
            }
            String::from_utf8_lossy(&bytes).into_owned()
        }
        _ => {
            let cut = rng.index(text.len() + 1);
            String::from_utf8_lossy(&text.as_bytes()[..cut]).into_owned()
        }
    }
}
