//! nbd-bench: placeholder, filled in below.
fn main() {}
