//! What the data-parallel tests (`distributed.rs`, `distributed_mpi.rs`, `distributed_nccl.rs`)
//! share: seeded tensors, since candle's CPU RNG cannot be seeded and every rank must be able to
//! build the same (or a deliberately different) model, and a model's parameters as plain values.

use module_runtime::prelude::*;

/// Deterministic, seed-dependent values of `shape` on `device`.
pub fn values(seed: u64, shape: &[usize], device: &Device) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| ((seed as f32 + 1.0) * 0.37 * (i as f32 + 1.0)).sin() * 0.5)
        .collect();
    Tensor::from_vec(v, shape, device).unwrap()
}

/// Every parameter of `model` by name, flattened to `f32`s, to compare models bit for bit.
#[allow(dead_code)] // distributed_mpi.rs compares parameters its own way
pub fn param_values<M: Module>(model: &M) -> Vec<(String, Vec<f32>)> {
    model
        .named_parameters()
        .into_iter()
        .map(|(n, p)| {
            (
                n,
                p.tensor()
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap(),
            )
        })
        .collect()
}
