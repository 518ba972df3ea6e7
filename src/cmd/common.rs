//! Shared by the subcommands: loading plans and rendering diagnostics.
