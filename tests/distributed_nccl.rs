//! The NCCL engine (issue #20) at world size 1 on one GPU: a data-parallel step equals a plain
//! CUDA step bit for bit, all-reduce and broadcast keep their meaning in place (offsets
//! included), and CPU tensors are refused with a typed error.
//!
//! ```text
//! cargo test -p candle-module --features nccl --test distributed_nccl
//! ```
//!
//! Needs a CUDA device and `libnccl.so` at run time. **No GPU was available to this project**:
//! CI only compiles this file (`cargo check --features cuda,nccl`), and without a CUDA device
//! each test prints a loud `SKIPPED` line and returns. Several GPUs are not tested at all.
#![cfg(feature = "nccl")]

use candle_nn::{Optimizer, SGD};
use module_runtime::distributed::{
    Collective, DdpConfig, DistributedDataParallel, DistributedError, Nccl, ReduceOp,
};
use module_runtime::prelude::*;

mod support;
use support::{param_values, values};

/// A one-rank NCCL group on `cuda:0`, or `None` (after a loud message) without a CUDA device.
fn nccl(test: &str) -> Option<Nccl> {
    let device = match module_runtime::parse_device("cuda:0") {
        Ok(Device::Cuda(device)) => device,
        other => {
            eprintln!("*** SKIPPED {test}: no CUDA device could be opened ({other:?}) ***");
            return None;
        }
    };
    Some(Nccl::new(0, 1, &device, Nccl::new_id().unwrap()).unwrap())
}

#[derive(Module)]
struct Net {
    fc1: Linear,
    fc2: Linear,
}

impl Net {
    fn new(device: &Device) -> Net {
        let linear = |seed, i, o| {
            Linear::from_tensors(
                values(seed, &[o, i], device),
                Some(values(seed + 100, &[o], device)),
            )
            .unwrap()
        };
        Net {
            fc1: linear(1, 6, 8),
            fc2: linear(2, 8, 3),
        }
    }
}

impl Forward<&Tensor> for Net {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc2.call(&self.fc1.call(x)?.tanh()?)
    }
}

#[test]
fn world_of_one_step_equals_a_plain_cuda_step_bit_for_bit() -> Result<()> {
    let Some(comm) = nccl("world_of_one_step_equals_a_plain_cuda_step_bit_for_bit") else {
        return Ok(());
    };
    let device = comm.device();
    assert!(device.is_cuda());
    let (x, y) = (values(7, &[8, 6], &device), values(8, &[8, 3], &device));
    let plain = Net::new(&device);
    let wrapped = Net::new(&device);
    let ddp =
        DistributedDataParallel::new(&wrapped, &comm, DdpConfig::default().bucket_cap_mb(0.0001))?;
    assert!(
        ddp.bucket_paths().len() > 1,
        "a small cap makes several buckets"
    );
    let mut opt_plain = SGD::new(plain.trainable_vars()?, 0.1)?;
    let mut opt_ddp = SGD::new(wrapped.trainable_vars()?, 0.1)?;
    for _ in 0..3 {
        let g = (plain.call(&x)? - &y)?.sqr()?.mean_all()?.backward()?;
        opt_plain.step(&g)?;
        let mut g = (ddp.call(&x)? - &y)?.sqr()?.mean_all()?.backward()?;
        ddp.reduce_gradients(&mut g)?;
        opt_ddp.step(&g)?;
    }
    assert_eq!(param_values(&plain), param_values(&wrapped));
    ddp.barrier()?;
    Ok(())
}

#[test]
fn all_reduce_and_broadcast_work_in_place_on_the_tensor_range() -> Result<()> {
    let Some(comm) = nccl("all_reduce_and_broadcast_work_in_place_on_the_tensor_range") else {
        return Ok(());
    };
    let device = comm.device();
    let base = Tensor::arange(0f32, 10., &device)?;
    // A view at an offset: only its 4 elements are touched, in place.
    let view = base.narrow(0, 3, 4)?;
    comm.all_reduce(&view, ReduceOp::Sum)?;
    comm.all_reduce(&view, ReduceOp::Avg)?;
    comm.broadcast(&view, 0)?;
    assert_eq!(view.to_vec1::<f32>()?, [3., 4., 5., 6.]);
    for dtype in [
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I64,
        DType::U32,
        DType::U8,
    ] {
        let t = Tensor::arange(0u32, 5, &device)?.to_dtype(dtype)?;
        comm.all_reduce(&t, ReduceOp::Sum)?;
        comm.broadcast(&t, 0)?;
        assert_eq!(
            t.to_dtype(DType::U32)?.to_vec1::<u32>()?,
            [0, 1, 2, 3, 4],
            "{dtype:?}"
        );
    }
    // A sum of one rank is the tensor itself, so a fresh value survives bit for bit.
    let x = values(3, &[5, 7], &device).to_dtype(DType::BF16)?;
    let before = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    comm.all_reduce(&x, ReduceOp::Avg)?;
    assert_eq!(
        x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
        before
    );
    comm.barrier()?;
    Ok(())
}

#[test]
fn cpu_tensors_bad_roots_and_integer_means_are_typed_errors() {
    let Some(comm) = nccl("cpu_tensors_bad_roots_and_integer_means_are_typed_errors") else {
        return;
    };
    let cpu = Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap();
    let err = comm.all_reduce(&cpu, ReduceOp::Sum).unwrap_err();
    match &err {
        Error::Distributed(DistributedError::Unsupported { backend, what }) => {
            assert_eq!(*backend, "nccl");
            assert!(what.contains("Cpu") && what.contains("Cuda"), "{what}");
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
    assert!(comm.broadcast(&cpu, 0).is_err());

    let gpu = Tensor::zeros(4, DType::U32, &comm.device()).unwrap();
    assert!(matches!(
        comm.all_reduce(&gpu, ReduceOp::Avg),
        Err(Error::Distributed(DistributedError::Unsupported { .. }))
    ));
    assert!(matches!(
        comm.broadcast(&gpu, 1),
        Err(Error::Distributed(DistributedError::InvalidRank {
            rank: 1,
            world_size: 1
        }))
    ));
    let strided = Tensor::zeros((3, 2), DType::F32, &comm.device())
        .unwrap()
        .t()
        .unwrap();
    assert!(comm.all_reduce(&strided, ReduceOp::Sum).is_err());

    // A model on the CPU under NCCL fails with the same error at the first collective.
    let model = Net::new(&Device::Cpu);
    let x = values(7, &[8, 6], &Device::Cpu);
    let ddp = DistributedDataParallel::new(&model, &comm, DdpConfig::default()).unwrap();
    let mut g = ddp.call(&x).unwrap().sum_all().unwrap().backward().unwrap();
    assert!(matches!(
        ddp.reduce_gradients(&mut g),
        Err(Error::Distributed(DistributedError::Unsupported { .. }))
    ));
}
