//! `rcoa validate`'s library: score the memory model's predictions against
//! measured training runs.
//!
//! A measured-run file ([`row`]) holds one JSON object per line: the machine
//! (`"record": "env"`) and the configurations run on it (`"record": "config"`),
//! each with its measured peak (`peak_train_B`) or `"oom": true`. Every
//! configuration becomes a `.plan` ([`plan`]), is compiled in-process, and its
//! predicted `memory.peak_bytes` is compared with the measurement ([`score`]).
//! The repository's own file is `tests/groundtruth/h100-pytorch.jsonl`.

pub mod plan;
pub mod row;
pub mod score;

pub use plan::plan_text;
pub use row::{read, FileError, MeasuredFile, MeasuredRun, RunConfig};
pub use score::{row_line, score, score_plan, Outcome, RowScore, Summary};
