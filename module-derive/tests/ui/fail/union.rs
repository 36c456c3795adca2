use module_runtime::Module;

#[derive(Module)]
union Weights {
    a: u32,
    b: f32,
}

fn main() {}
