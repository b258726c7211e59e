//! Wall-clock time as the layers above the store record it.
//!
//! Records, progress reports and idle timers all stamp "now" as milliseconds since the Unix epoch, and
//! each crate used to write its own copy of that one line. This is the one copy for every crate that
//! depends on clade-core (the store and the ledger sit below it and keep their own clocks; the ledger's
//! `Clock` is the one to use where a test must control time).

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, now; 0 if the clock reads before 1970.
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn now_ms_reads_milliseconds_since_the_epoch() {
        let ms = now_ms();
        // Between 2020-01-01 and 2100-01-01 in milliseconds (seconds or microseconds would fall outside).
        assert!((1_577_836_800_000..4_102_444_800_000).contains(&ms), "{ms}");
    }
}
