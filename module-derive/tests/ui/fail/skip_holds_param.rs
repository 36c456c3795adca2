use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use module_runtime::{Buffer, Module, Param};

// `skip` on anything that holds a `Param` or a `Buffer` would leave them out of training and
// checkpoints, however deep they sit in the type.
#[derive(Module)]
struct Net {
    #[module(skip)]
    bias: Option<Param>,
    #[module(skip)]
    stats: Vec<Buffer>,
    #[module(skip)]
    pair: [module_runtime::Param; 2],
    #[module(skip)]
    mixed: (usize, Box<Buffer>),
    #[module(skip)]
    by_name: HashMap<String, Arc<Mutex<Param>>>,
}

fn main() {}
