//! Hand-written CubeCL kernels and their plain-tensor counterparts.

pub mod flash;
