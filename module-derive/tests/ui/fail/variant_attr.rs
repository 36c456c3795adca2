use module_runtime::nn::Linear;
use module_runtime::Module;

#[derive(Module)]
enum Head {
    #[module(rename = "proj")]
    Linear(Linear),
    Identity,
}

fn main() {}
