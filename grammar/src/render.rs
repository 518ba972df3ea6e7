//! Deterministic text for diagnostics.
//!
//! Golden tests and non-terminal stderr need the same bytes on every machine:
//! no colours, no hyperlinks, no dependence on the terminal's width. This is
//! the only place that fixes those choices, so every crate's diagnostics
//! (parse, resolve, compile) render alike.

use miette::{Diagnostic, GraphicalReportHandler, GraphicalTheme};

/// Width of rendered diagnostics, in columns.
pub const WIDTH: usize = 100;

/// Renders any diagnostic with miette's graphical handler: unicode box
/// drawing, no colour, width [`WIDTH`], no links or URLs.
pub fn render_plain(diag: &dyn Diagnostic) -> String {
    let handler = GraphicalReportHandler::new_themed(GraphicalTheme::unicode_nocolor())
        .with_width(WIDTH)
        .with_links(false)
        .with_urls(false);
    let mut out = String::new();
    if handler.render_report(&mut out, diag).is_err() {
        // Rendering only fails if the writer fails; a String never does.
        // Fall back to the headline rather than panicking.
        out = diag.to_string();
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn renders_code_label_and_help_without_colour() {
        let err = crate::parse("t.plan", "train { seq_len 2048 }").unwrap_err();
        let text = super::render_plain(&err);
        assert!(text.contains("rcoa::syntax::expected_equals"), "{text}");
        assert!(text.contains("t.plan:1:17"), "{text}");
        assert!(text.contains("help:"), "{text}");
        assert!(!text.contains('\u{1b}'), "no escape codes: {text:?}");
    }
}
