use module_runtime::{Module, Param};

#[derive(Module)]
struct Net {
    #[module(skip)]
    weight: Param,
}

fn main() {}
