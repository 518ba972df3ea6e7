//! Golden diagnostics: each test holds its own plan text; the expected
//! rendering (render_plain: no colour, width 100) is an insta snapshot in
//! `tests/snapshots/`. Re-bless after an intended wording change with
//! `INSTA_UPDATE=always cargo test -p rcoa-grammar --test diagnostics`
//! (or `cargo insta review`), then read the diff.

use rcoa_grammar::{decode_utf8, parse, render::render_plain};

/// Parses `source` (expected to fail) and renders the diagnostic, headed by
/// its code so the snapshot shows both.
fn diag(source: &str) -> String {
    match parse("example.plan", source) {
        Ok(_) => panic!("expected a parse error for {source:?}"),
        Err(e) => render_plain(&e),
    }
}

macro_rules! golden {
    ($name:ident, $src:expr) => {
        #[test]
        fn $name() {
            insta::assert_snapshot!(diag($src));
        }
    };
}

golden!(
    unclosed_block,
    "model \"llama-3.1-8b\"\n\nhardware {\n  gpu = a100-40gb\n  gpus_per_node = 4\n\ntrain { seq_len = 2048  global_batch = 256 }\n"
);
golden!(
    unterminated_string,
    "model \"llama-3.1-8b\n\nhardware { gpu = a100-40gb }\n"
);
golden!(invalid_escape, "model hf \"configs\\new.json\"\n");
golden!(
    missing_equals,
    "optimizer adamw {\n  lr 2e-5\n  weight_decay = 0.1\n}\n"
);
golden!(
    equals_without_value,
    "train {\n  seq_len =\n  global_batch = 256\n}\n"
);
golden!(unit_without_number, "fit { budget = GiB }\n");
golden!(lowercase_unit, "fit { budget = 38 gib }\n");
golden!(glued_unknown_unit, "hardware { host_memory = 512gigs }\n");
golden!(
    binary_bandwidth_unit,
    "hardware { intra_node = 600 GiB/s }\n"
);
golden!(
    lowercase_bandwidth_unit,
    "hardware { intra_node = 600 gb/s }\n"
);
golden!(bits_per_second_unit, "hardware { inter_node = 400 Gb/s }\n");
golden!(detached_count_suffix, "train { global_batch = 1 M }\n");
golden!(uppercase_name, "precision BF16\n");
golden!(
    entry_outside_block,
    "model \"llama-3.1-8b\"\nseq_len = 2048\n"
);
golden!(
    mismatched_bracket,
    "fit {\n  offload = [optimizer, params\n}\n"
);
golden!(stray_closing_brace, "hardware { gpu = h100-80gb }\n}\n");
golden!(semicolon_separator, "parallel { zero = 3; tensor = 2 }\n");
golden!(single_quoted_string, "model 'llama-3.1-8b'\n");
golden!(expected_section_name, "model \"x\"\n42\n");
golden!(expected_key, "train {\n  \"seq_len\" = 2048\n}\n");
golden!(
    double_comma_in_tuple,
    "optimizer adamw { betas = (0.9,, 0.95) }\n"
);
golden!(number_out_of_range, "train { steps = 1e400 }\n");
golden!(
    too_deep,
    &format!("x {{ v = {}1{} }}\n", "[".repeat(70), "]".repeat(70))
);

golden!(malformed_number, "train { steps = 1. }\n");
golden!(bare_exponent, "optimizer adamw { lr = 2e }\n");
golden!(argument_on_next_line, "model\n  \"llama-3.1-8b\"\n");
golden!(leading_dot, "fit { budget = .5 }\n");

golden!(extra_value, "optimizer adamw { betas = 0.9 0.95 }\n");
golden!(
    colon_instead_of_equals,
    "model \"llama-3.1-8b\" {\n  layers: 2\n}\n"
);

#[test]
fn invalid_utf8() {
    let bytes = b"model \"llama\xff-3\"\n";
    let e = decode_utf8("example.plan", bytes).unwrap_err();
    insta::assert_snapshot!(render_plain(&e));
}
