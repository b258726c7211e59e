//! Fuzzes the agent's frame decoder: `wire::decode` on the input, the blocking stream reader over it
//! (as the agent reads a connection), and the request/response body parsers on every frame found.
#![no_main]

use clade_agent::wire::{decode, read_frame, Decoded, ReadOutcome, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match decode(data) {
        Decoded::Frame(f, used) => {
            assert!(used <= data.len());
            assert_eq!(f.body.len() + 4 + HEADER_LEN, used);
        }
        Decoded::Bad(_, used) => assert!(used >= 4),
        Decoded::Incomplete(n) => assert!(n > data.len()),
    }
    let mut r = data;
    let mut frames = 0;
    while let Ok(o) = read_frame(&mut r) {
        match o {
            ReadOutcome::Eof => break,
            ReadOutcome::Frame(f) => {
                let _ = clade_agent::Request::parse(&f.body);
                let _ = serde_json::from_slice::<clade_agent::Response>(&f.body);
                let _ = serde_json::from_slice::<clade_agent::Event>(&f.body);
            }
            ReadOutcome::Bad(_) => {}
        }
        frames += 1;
        assert!(frames <= data.len());
    }
});
