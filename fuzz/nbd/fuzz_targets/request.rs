//! The pure parsers of client frames: request headers and option payloads must never panic and
//! must agree with the encoder.
#![no_main]

use clade_nbd::proto::{encode_request, parse_info_request, parse_meta_request, parse_request, Cmd};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = parse_request(data) {
        let ty = match r.cmd {
            Cmd::Read => 0,
            Cmd::Write => 1,
            Cmd::Disc => 2,
            Cmd::Flush => 3,
            Cmd::Trim => 4,
            Cmd::Cache => 5,
            Cmd::WriteZeroes => 6,
            Cmd::BlockStatus => 7,
            Cmd::Unknown(t) => t,
        };
        assert_eq!(&encode_request(r.flags, ty, r.cookie, r.offset, r.len)[..], &data[..28]);
    }
    let _ = parse_info_request(data);
    let _ = parse_meta_request(data);
});
