//! Reproducible runs: `manual_seed` (two runs seeded alike are bit-identical, differently seeded
//! ones differ), the training checkpoint (a run saved, restored and continued equals the
//! uninterrupted one, bit for bit, also when the `train_digits` example is killed while it writes
//! one: `killed_training`) and activation checkpointing (checkpointed training equals plain
//! training, bit for bit, dropout included).
//!
//! A binary of its own: the runtime's generator is the process's, and the tests of the other
//! binaries build layers (and so draw from it) on many threads at once. Here every test holds
//! [`serial`] while it draws, so each sees only its own draws.

mod activation_checkpoint;
mod checkpoint;
mod checkpoint_pattern;
mod killed_training;
mod seeds;

use std::sync::{Mutex, MutexGuard, PoisonError};

use module_runtime::StateDict;

/// Held by each test for its whole run: one test at a time draws from the generator.
pub fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Tensors' bytes by key: equal when bit-identical.
pub type Bits = Vec<(String, Vec<u8>)>;

/// A state dict's tensors as their bytes, by key: equal when bit-identical.
pub fn bits(sd: &StateDict) -> Bits {
    sd.iter()
        .map(|(k, t)| {
            let t = t
                .flatten_all()
                .unwrap()
                .to_dtype(module_runtime::prelude::DType::F32)
                .unwrap();
            let bytes = t
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .flat_map(|v| v.to_bits().to_le_bytes())
                .collect();
            (k.to_owned(), bytes)
        })
        .collect()
}
