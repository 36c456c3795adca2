use module_runtime::Module;

struct Config {
    width: usize,
}

#[derive(Module)]
struct Net {
    config: Config,
}

fn main() {}
