use module_runtime::Module;

struct Settings {
    eps: f64,
}

#[derive(Module)]
struct Net {
    #[module(flatten)]
    settings: Settings,
}

fn main() {}
