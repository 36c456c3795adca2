//! The optimizer and scheduler state readers: a file read as a state dict (safetensors or `.pth`)
//! and loaded into AdamW, SGD and the schedules, and `torch.optim`'s numbered state read from a
//! PyTorch checkpoint (`read_pth_state`); the file's Python values (`PthValues`) and a scheduler
//! state read from them (`read_pth_scheduler_state`).
#![no_main]

use candle_module_fuzz::{with_file, Net};
use libfuzzer_sys::fuzz_target;
use module_runtime::optim::{
    read_pth_scheduler_state, read_pth_state, AdamW, LambdaLr, LrScheduler, Optimizer,
    SgdOptions, StepLr, SGD,
};
use module_runtime::prelude::*;
use module_runtime::PthValues;

fuzz_target!(|data: &[u8]| {
    with_file("optim_state", data, |path| {
        let net = Net::new();
        let mut adamw = AdamW::new(&net, AdamW::options()).unwrap();
        let mut sgd = SGD::new(&net, SgdOptions::new(0.1).momentum(0.9)).unwrap();
        if let Ok(state) = StateDict::read(path, &LoadOptions::default()) {
            let _ = adamw.load_state_dict(&state);
            let _ = sgd.load_state_dict(&state);
            let mut schedule = StepLr::new(&mut adamw, 2, 0.5);
            let _ = schedule.load_state_dict(&state, &mut adamw);
        }
        for key in [None, Some("optimizer")] {
            if let Ok(state) = read_pth_state(path, key, &adamw) {
                let _ = adamw.load_state_dict(&state);
            }
            if let Ok(state) = read_pth_state(path, key, &sgd) {
                let _ = sgd.load_state_dict(&state);
            }
        }
        if let Ok(ckpt) = PthValues::load(path) {
            let mut step = StepLr::new(&mut adamw, 2, 0.5);
            let mut lambda = LambdaLr::constant(&mut sgd);
            for value in [Some(ckpt.root()), ckpt.get("scheduler").ok()].into_iter().flatten() {
                if let Ok(state) = read_pth_scheduler_state(value, &step) {
                    let _ = step.load_state_dict(&state, &mut adamw);
                }
                if let Ok(state) = read_pth_scheduler_state(value, &lambda) {
                    let _ = lambda.load_state_dict(&state, &mut sgd);
                }
            }
            let _ = ckpt.extract::<Vec<f64>>("extra.tags");
        }
    });
});
