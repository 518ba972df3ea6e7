//! Fuzz target: any bytes through `decode_utf8` → `parse` → `format`.
//!
//! Checks more than "no panic": a rejected plan must render as a diagnostic,
//! and an accepted one must format to text that parses to the same tree and
//! formats to itself.

#![no_main]

use libfuzzer_sys::fuzz_target;
use rcoa_grammar::{decode_utf8, format, format::without_spans, parse, render::render_plain};

fuzz_target!(|data: &[u8]| {
    let text = match decode_utf8("fuzz.plan", data) {
        Ok(text) => text,
        Err(e) => {
            let _ = render_plain(&e);
            return;
        }
    };
    match parse("fuzz.plan", text) {
        Ok(file) => {
            let out = format(&file, text);
            let again = match parse("formatted.plan", &out) {
                Ok(f) => f,
                Err(e) => panic!("formatted text does not parse: {e}\n{out}"),
            };
            assert_eq!(without_spans(&file), without_spans(&again), "tree changed:\n{out}");
            assert_eq!(format(&again, &out), out, "format is not idempotent");
        }
        Err(e) => {
            let _ = render_plain(&e);
        }
    }
});
