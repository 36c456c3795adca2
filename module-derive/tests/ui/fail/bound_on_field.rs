use module_runtime::Module;

#[derive(Module)]
struct Wrapper<T> {
    #[module(bound = "T: Module")]
    inner: T,
}

fn main() {}
