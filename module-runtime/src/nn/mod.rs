//! Layers, written with `#[derive(Module)]`, with PyTorch's parameter names, layouts and default
//! initialization.

mod linear;

pub use linear::Linear;
