//! GGUF: the bounded header reader, every tensor dequantized, and `LlamaForCausalLM::from_gguf`
//! (the metadata checked against the tensors, the model built and loaded).
#![no_main]

use candle_module_fuzz::with_file;
use libfuzzer_sys::fuzz_target;
use module_runtime::prelude::*;
use module_runtime::GgufFile;

fuzz_target!(|data: &[u8]| {
    with_file("gguf", data, |path| {
        if let Ok(file) = GgufFile::read(path, &Device::Cpu) {
            for t in file.tensors.values() {
                let _ = t.dequantize(&Device::Cpu);
            }
        }
        let _ = llama::LlamaForCausalLM::from_gguf(path, &Device::Cpu);
    });
});
