mod global;
pub use global::*;

mod config;
pub use config::*;

mod api;
pub use api::*;

mod local;

// rcoa patch: operations run as their caller's stream (tested by rcoa-backend).
pub use local::server::OnStream;
