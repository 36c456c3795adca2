use module_runtime::Module;

#[derive(Module)]
#[module(bound(T: Module))]
struct Wrapper<T> {
    inner: T,
}

fn main() {}
