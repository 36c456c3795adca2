//! Safetensors: the header and data checks (`StateDict::read` reads every tensor), and a strict
//! load into a model, which must change nothing when it fails.
#![no_main]

use candle_module_fuzz::with_file;
use libfuzzer_sys::fuzz_target;
use module_runtime::prelude::*;

fuzz_target!(|data: &[u8]| {
    with_file("safetensors", data, |path| {
        let _ = StateDict::read(path, &LoadOptions::default());
        let model = Linear::new(2, 2, &Device::Cpu).unwrap();
        let before = model.weight.tensor().unwrap().to_vec2::<f32>().unwrap();
        if model
            .load_state_dict(path, &LoadOptions::default())
            .is_err()
        {
            assert_eq!(
                model.weight.tensor().unwrap().to_vec2::<f32>().unwrap(),
                before
            );
        }
    });
});
