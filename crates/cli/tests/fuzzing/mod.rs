//! The seeded JSON mutator of the CLI fuzz tests (`plan.rs`, `check.rs`).

use serde_json::{Value, json};

/// SplitMix64: a seeded generator, so every run mutates the same way.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// One mutation of a JSON object: one of `fields` set to an extreme (integer edges, negative,
/// float, wrong types, an array longer than any maximum), an element of one of `lists` set to
/// an extreme, a bit flip, or a truncation. Accepted values stay small, so every run is quick
/// by construction.
pub(crate) fn mutate(text: &str, fields: &[&str], lists: &[&str], rng: &mut Rng) -> String {
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
    match rng.below(4) {
        0 | 1 => match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(mut o)) => {
                let v = extremes[rng.below(extremes.len())].clone();
                if rng.below(2) == 0 {
                    o.insert(fields[rng.below(fields.len())].to_owned(), v);
                } else if let Some(Value::Array(items)) = o.get_mut(lists[rng.below(lists.len())]) {
                    if !items.is_empty() {
                        let i = rng.below(items.len());
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
                let i = rng.below(bytes.len());
                bytes[i] ^= 1 << rng.below(8);
            }
            String::from_utf8_lossy(&bytes).into_owned()
        }
        _ => {
            let cut = rng.below(text.len() + 1);
            String::from_utf8_lossy(&text.as_bytes()[..cut]).into_owned()
        }
    }
}
