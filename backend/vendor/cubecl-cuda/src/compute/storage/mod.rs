pub mod cpu;
pub mod expandable;
pub mod gpu;
