//! Planner benchmarks (divan).

fn main() {
    divan::main();
}
