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

/// Writes `files` (name, bytes) into this process's scratch folder (one per target and process,
/// emptied first) and calls `f` with its path.
pub fn with_dir<R>(target: &str, files: &[(&str, &[u8])], f: impl FnOnce(&Path) -> R) -> R {
    let dir: PathBuf = std::env::temp_dir().join(format!(
        "candle-module-fuzz-{target}-{}.d",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("the scratch folder can be made");
    for (name, bytes) in files {
        std::fs::write(dir.join(name), bytes).expect("the scratch file can be written");
    }
    f(&dir)
}

/// The PEFT fixtures' attention (`fixtures/peft/make_fixtures.py`).
#[derive(Module)]
pub struct TinyAttention {
    pub q_proj: Linear,
    pub v_proj: Linear,
}

/// The PEFT fixtures' MLP.
#[derive(Module)]
pub struct TinyMlp {
    pub fc1: Linear,
    pub fc2: Linear,
}

/// The PEFT fixtures' model: `Tiny(vocab=12, d=16, hidden=32)`, whose adapters the `peft` target's
/// seeds are.
#[derive(Module)]
pub struct Tiny {
    pub embed: module_runtime::nn::Embedding,
    pub attn: TinyAttention,
    pub mlp: TinyMlp,
    pub head: Linear,
}

impl Tiny {
    pub fn new() -> Self {
        let dev = Device::Cpu;
        Self {
            embed: module_runtime::nn::Embedding::new(12, 16, &dev).unwrap(),
            attn: TinyAttention {
                q_proj: Linear::new(16, 16, &dev).unwrap(),
                v_proj: Linear::no_bias(16, 16, &dev).unwrap(),
            },
            mlp: TinyMlp {
                fc1: Linear::new(16, 32, &dev).unwrap(),
                fc2: Linear::new(32, 16, &dev).unwrap(),
            },
            head: Linear::new(16, 12, &dev).unwrap(),
        }
    }
}

impl Default for Tiny {
    fn default() -> Self {
        Self::new()
    }
}
