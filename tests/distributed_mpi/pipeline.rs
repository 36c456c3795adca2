//! Pipeline parallelism over 2 MPI ranks (`pipeline_under_mpiexec` in `distributed_mpi.rs` runs
//! `pipeline_rank` under `mpiexec -n 2`).

use candle_core::backprop::GradStore;
use module_runtime::distributed::Collective;
use module_runtime::optim::AdamW;
use module_runtime::prelude::*;

use super::{agree, values, AnyResult};

/// A model of a first layer, blocks and a head, for the pipeline.
#[derive(Module)]
struct Deep {
    embed: Linear,
    layers: Vec<Linear>,
    head: Linear,
}

impl Deep {
    /// `build_empty(|| Deep::new(false))` draws nothing; `Deep::new(true)` has seeded weights.
    fn new(seeded: bool) -> Result<Deep> {
        let lin = |i, o| Linear::new(i, o, &Device::Cpu);
        let deep = Deep {
            embed: lin(6, 8)?,
            layers: (0..4).map(|_| lin(8, 8)).collect::<Result<_>>()?,
            head: lin(8, 3)?,
        };
        if seeded {
            for (i, p) in deep.parameters().iter().enumerate() {
                p.set(&values(40 + i as u64, p.shape().dims(), &Device::Cpu))?;
            }
        }
        Ok(deep)
    }

    /// Stage 0 (`embed`, `layers.0..2`), stage 1 (`layers.2..4`, `head`), or both.
    fn run(&self, x: &Tensor, stages: std::ops::RangeInclusive<usize>) -> Result<Tensor> {
        let mut h = x.clone();
        if stages.contains(&0) {
            h = self.embed.call(&h)?.tanh()?;
            for l in &self.layers[..2] {
                h = (l.call(&h)?.tanh()? + &h)?;
            }
        }
        if stages.contains(&1) {
            for l in &self.layers[2..] {
                h = (l.call(&h)?.tanh()? + &h)?;
            }
            h = self.head.call(&h)?;
        }
        Ok(h)
    }
}

/// Pipeline parallelism over MPI: `send`/`recv` (bf16 bits exact, a wrong shape refused and
/// consumed), then `Deep` split over the 2 ranks by path, built empty and loaded per stage, 3
/// AdamW steps of 4 micro-batches under GPipe and under 1F1B: the last stage's losses and each
/// stage's weights bitwise equal to one process accumulating the same micro-batches.
#[test]
fn pipeline_rank() -> AnyResult<()> {
    use module_runtime::distributed::{
        Mpi, PipelineSplit, PipelineStage, Schedule1F1B, ScheduleGPipe,
    };
    use module_runtime::optim::{Optimizer, ParamList};
    if std::env::var_os("DDP_MPI_CHILD").is_none() {
        return Ok(());
    }
    let comm = Mpi::init()?;
    let (rank, dev) = (comm.rank(), Device::Cpu);
    let peer = 1 - rank;

    // Point to point: exact bits of a bf16 tensor, a refused shape that consumes its message.
    let sent = values(3, &[2, 3], &dev).to_dtype(DType::BF16)?;
    let mut ok = true;
    if rank == 0 {
        comm.send(&sent, peer)?;
        comm.send(&sent, peer)?;
    } else {
        let wrong = Tensor::zeros((3, 2), DType::BF16, &dev)?;
        let e = comm.recv(&wrong, peer).unwrap_err();
        ok &= e.to_string().contains("shape [2, 3]");
        let got = Tensor::zeros((2, 3), DType::BF16, &dev)?;
        comm.recv(&got, peer)?;
        ok &= got.to_dtype(DType::F32)?.to_vec2::<f32>()?
            == sent.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    }
    agree(&comm, ok, "send/recv over MPI")?;

    let mse = |y: &Tensor, t: &Tensor| -> Result<Tensor> { Ok((y - t)?.sqr()?.mean_all()?) };
    let adamw = |params| AdamW::new(&ParamList(params), AdamW::options().lr(0.05)).unwrap();
    let (x, y) = (values(7, &[8, 6], &dev), values(8, &[8, 3], &dev));
    let (steps, n_mb, rows) = (3, 4, 2);

    // The reference: one process, the micro-batches' gradients summed in order, then divided.
    let single = Deep::new(true)?;
    // Another instance: a state dict shares storage with its model, which the steps update.
    let initial = Deep::new(true)?.state_dict()?;
    let mut opt = adamw(single.named_parameters());
    let mut want_losses = Vec::new();
    for _ in 0..steps {
        let mut sums: Vec<Option<Tensor>> = vec![None; single.parameters().len()];
        for k in 0..n_mb {
            let out = single.run(&x.narrow(0, k * rows, rows)?, 0..=1)?;
            let loss = mse(&out, &y.narrow(0, k * rows, rows)?)?;
            want_losses.push(loss.to_scalar::<f32>()?);
            let g = loss.backward()?;
            for (sum, p) in sums.iter_mut().zip(single.parameters()) {
                let gp = g.get(p.var()?.as_tensor()).unwrap().clone();
                *sum = Some(match sum.take() {
                    Some(s) => (s + gp)?,
                    None => gp,
                });
            }
        }
        let mut grads = GradStore::default();
        let n = Tensor::new(n_mb as f32, &dev)?;
        for (sum, p) in sums.into_iter().zip(single.parameters()) {
            grads.insert(p.var()?.as_tensor(), sum.unwrap().broadcast_div(&n)?);
        }
        opt.step(&grads)?;
    }
    let want = single.state_dict()?;

    let split = PipelineSplit::new([
        vec!["embed", "layers.0", "layers.1"],
        vec!["layers.2", "layers.3", "head"],
    ])?;
    for one_f_one_b in [false, true] {
        let model = module_runtime::build_empty(|| Deep::new(false))?;
        let stage = PipelineStage::new(&model, &split, &comm, |h| model.run(h, rank..=rank))?;
        stage.load_state_dict(&initial)?;
        let mut opt = adamw(stage.named_parameters().to_vec());
        let (first, last) = (stage.is_first(), stage.is_last());
        let mut losses = Vec::new();
        for _ in 0..steps {
            let (input, target) = (first.then_some(&x), last.then_some(&y));
            let step = if one_f_one_b {
                Schedule1F1B::new(&stage, n_mb, mse)?.step(input, target)?
            } else {
                ScheduleGPipe::new(&stage, n_mb, mse)?.step(input, target)?
            };
            opt.step(&step.grads)?;
            for l in &step.losses {
                losses.push(l.to_scalar::<f32>()?);
            }
        }
        let mut ok = !last || losses == want_losses;
        let mine = stage.state_dict()?;
        ok &= mine.keys().count() == 6;
        for (key, value) in mine.iter() {
            let (a, b) = (value.flatten_all()?, want.get(key).unwrap().flatten_all()?);
            let (a, b) = (a.to_vec1::<f32>()?, b.to_vec1::<f32>()?);
            let same = a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits());
            if !same {
                eprintln!("rank {rank}: {key} differs: {:?} vs {:?}", &a[..3], &b[..3]);
            }
            ok &= same;
        }
        if !ok {
            eprintln!("rank {rank}: losses {losses:?} want {want_losses:?}");
        }
        // The other stage's weights were never built on this rank.
        ok &= model
            .named_parameters()
            .iter()
            .all(|(path, p)| p.is_built() == stage.paths().contains(path));
        let schedule = if one_f_one_b { "1F1B" } else { "GPipe" };
        agree(
            &comm,
            ok,
            &format!("{schedule} pipeline against one process"),
        )?;
    }
    println!("rank ok");
    Ok(())
}
