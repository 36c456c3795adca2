//! PyTorch checkpoints, zip and legacy: the container, the bounded pickle machine, the tensors'
//! layouts against their storages, a nested state dict chosen by key, and the tree reader.
#![no_main]

use candle_module_fuzz::with_file;
use libfuzzer_sys::fuzz_target;
use module_runtime::prelude::*;

fuzz_target!(|data: &[u8]| {
    with_file("pth", data, |path| {
        let _ = StateDict::read(path, &LoadOptions::default());
        let _ = StateDict::read(path, &LoadOptions::default().nested_in("model"));
    });
});
