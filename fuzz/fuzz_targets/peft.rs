//! The PEFT adapter readers: `adapter_config.json` parsed (`LoraConfig::from_json_str`) and
//! applied to a model (`get_peft_model`), and a whole adapter folder loaded (`load_adapter`). An
//! input is the config's length (2 bytes, little-endian), the config, then the
//! `adapter_model.safetensors` bytes (`fuzz/seed.sh` makes the seeds from the PEFT fixtures).
#![no_main]

use candle_module_fuzz::{with_dir, Tiny};
use libfuzzer_sys::fuzz_target;
use module_runtime::nn::peft::{get_peft_model, LoraConfig, PeftExt};

fuzz_target!(|data: &[u8]| {
    let Some((len, rest)) = data.split_first_chunk::<2>() else {
        return;
    };
    let len = (u16::from_le_bytes(*len) as usize).min(rest.len());
    let (config, weights) = rest.split_at(len);
    if let Ok(text) = std::str::from_utf8(config) {
        if let Ok(config) = LoraConfig::from_json_str(text) {
            let _ = config.to_json();
            let _ = get_peft_model(&mut Tiny::new(), &config);
        }
    }
    with_dir(
        "peft",
        &[
            ("adapter_config.json", config),
            ("adapter_model.safetensors", weights),
        ],
        |dir| {
            let mut model = Tiny::new();
            let _ = model.load_adapter(dir, "default", false);
        },
    );
});
