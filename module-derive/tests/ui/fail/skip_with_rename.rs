use module_runtime::Module;

#[derive(Module)]
struct Net {
    #[module(skip, rename = "eps")]
    epsilon: f64,
}

fn main() {}
