use module_runtime::prelude::*;

// `class_name` takes a value, and belongs on the type.
#[derive(Module)]
#[module(class_name)]
struct Net {
    #[module(class_name = "Head")]
    fc: Linear,
}

fn main() {}
