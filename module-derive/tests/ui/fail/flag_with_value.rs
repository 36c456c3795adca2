use module_runtime::Module;

#[derive(Module)]
struct Net {
    #[module(skip = true)]
    epsilon: f64,
}

fn main() {}
