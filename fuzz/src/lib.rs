//! What the fuzz targets share: the readers take paths, so each input is written to a file of
//! the fuzzing process's own first; and the small models the loads go into.

use std::path::{Path, PathBuf};

use module_runtime::nn::LayerNorm;
use module_runtime::prelude::*;

/// Writes `data` to this process's scratch file (one per target and process, in the temporary
/// folder) and calls `f` with its path.
pub fn with_file<R>(target: &str, data: &[u8], f: impl FnOnce(&Path) -> R) -> R {
    let path: PathBuf = std::env::temp_dir().join(format!(
        "candle-module-fuzz-{target}-{}",
        std::process::id()
    ));
    std::fs::write(&path, data).expect("the scratch file can be written");
    f(&path)
}

/// The optimizer fixtures' model (`fixtures/make_optim_pth_fixtures.py`): fc1 Linear(6, 8), norm
/// LayerNorm(8), fc2 Linear(8, 3).
#[derive(Module)]
pub struct Net {
    pub fc1: Linear,
    pub norm: LayerNorm,
    pub fc2: Linear,
}

impl Net {
    pub fn new() -> Self {
        let dev = Device::Cpu;
        Self {
            fc1: Linear::new(6, 8, &dev).unwrap(),
            norm: LayerNorm::new(8, &dev).unwrap(),
            fc2: Linear::new(8, 3, &dev).unwrap(),
        }
    }
}

impl Default for Net {
    fn default() -> Self {
        Self::new()
    }
}
