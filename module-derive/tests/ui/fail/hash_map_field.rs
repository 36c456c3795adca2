use std::collections::HashMap;

use module_runtime::nn::Linear;
use module_runtime::Module;

#[derive(Module)]
struct Heads {
    heads: HashMap<String, Linear>,
}

fn main() {}
