//! Point-to-point `send`/`recv` on `LocalGroup` and `SingleProcess`, and what the pipeline
//! refuses: bad peers, a received shape or dtype that does not fit, a split that does not cover
//! the model (or splits a tied weight), micro-batches that do not divide the batch, a stage
//! forward that reads another stage's weights. Every refusal is typed and changes nothing.

use std::time::Duration;

use module_runtime::distributed::{
    Collective, DistributedError, LocalGroup, PipelineSplit, PipelineStage, ScheduleGPipe,
    SingleProcess,
};
use module_runtime::prelude::*;

fn dist(e: &Error) -> &DistributedError {
    match e.inner() {
        Error::Distributed(d) => d,
        other => panic!("not a distributed error: {other}"),
    }
}

/// Runs `f` on every rank of a `LocalGroup` of `n` (each its own thread), with a timeout.
fn on_ranks<T: Send>(n: usize, timeout: Duration, f: impl Fn(LocalGroup) -> T + Sync) -> Vec<T> {
    let ranks = LocalGroup::with_timeout(n, timeout).unwrap();
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = ranks.into_iter().map(|c| s.spawn(move || f(c))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn send_and_recv_carry_values_in_order() {
    let got = on_ranks(
        3,
        Duration::from_secs(30),
        |comm| -> Result<Vec<Vec<f32>>> {
            let dev = Device::Cpu;
            match comm.rank() {
                0 => {
                    // Any layout: a transposed view is sent by its values.
                    let a = Tensor::arange(0f32, 6., &dev)?.reshape((2, 3))?.t()?;
                    comm.send(&a, 2)?;
                    comm.send(
                        &Tensor::new(&[1.5f32, -2.0], &dev)?.to_dtype(DType::BF16)?,
                        2,
                    )?;
                    Ok(vec![])
                }
                1 => Ok(vec![]),
                _ => {
                    let a = Tensor::zeros((3, 2), DType::F32, &dev)?;
                    comm.recv(&a, 0)?;
                    let b = Tensor::zeros(2, DType::BF16, &dev)?;
                    comm.recv(&b, 0)?;
                    Ok(vec![
                        a.flatten_all()?.to_vec1()?,
                        b.to_dtype(DType::F32)?.to_vec1()?,
                    ])
                }
            }
        },
    );
    let got: Vec<_> = got.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(got[2], [vec![0., 3., 1., 4., 2., 5.], vec![1.5, -2.0]]);
}

#[test]
fn bad_peers_and_mismatched_messages_are_typed_errors() {
    // One process: no peer exists.
    let t = Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
    let e = SingleProcess.send(&t, 0).unwrap_err();
    assert_eq!(
        dist(&e),
        &DistributedError::PeerIsSelf {
            op: "send",
            rank: 0
        }
    );
    let e = SingleProcess.recv(&t, 1).unwrap_err();
    assert!(matches!(
        dist(&e),
        DistributedError::InvalidRank {
            rank: 1,
            world_size: 1
        }
    ));

    let out = on_ranks(2, Duration::from_secs(30), |comm| -> Result<()> {
        let dev = Device::Cpu;
        if comm.rank() == 0 {
            let e = comm
                .send(&Tensor::zeros(2, DType::F32, &dev)?, 2)
                .unwrap_err();
            assert!(matches!(
                dist(&e),
                DistributedError::InvalidRank {
                    rank: 2,
                    world_size: 2
                }
            ));
            let e = comm
                .recv(&Tensor::zeros(2, DType::F32, &dev)?, 0)
                .unwrap_err();
            assert!(matches!(
                dist(&e),
                DistributedError::PeerIsSelf { op: "recv", .. }
            ));
            comm.send(&Tensor::ones((2, 3), DType::F32, &dev)?, 1)?;
            comm.send(&Tensor::ones((2, 3), DType::F32, &dev)?, 1)?;
            comm.send(&Tensor::new(&[7f32, 8.], &dev)?, 1)?;
        } else {
            // The wrong shape, then the wrong dtype: refused, the tensor unchanged, the message
            // consumed (the next receive gets the next message).
            let wrong = Tensor::zeros((3, 2), DType::F32, &dev)?;
            let e = comm.recv(&wrong, 0).unwrap_err();
            let msg = e.to_string();
            assert!(matches!(dist(&e), DistributedError::OpMismatch { .. }));
            assert!(msg.contains("[3, 2]") && msg.contains("[2, 3]"), "{msg}");
            assert_eq!(wrong.sum_all()?.to_scalar::<f32>()?, 0.0);
            let e = comm
                .recv(&Tensor::zeros((2, 3), DType::F64, &dev)?, 0)
                .unwrap_err();
            assert!(e.to_string().contains("F64"), "{e}");
            let right = Tensor::zeros(2, DType::F32, &dev)?;
            comm.recv(&right, 0)?;
            assert_eq!(right.to_vec1::<f32>()?, [7., 8.]);
        }
        Ok(())
    });
    out.into_iter().for_each(|r| r.unwrap());
}

#[test]
fn a_recv_nobody_sends_times_out() {
    let out = on_ranks(2, Duration::from_millis(200), |comm| {
        if comm.rank() == 1 {
            let e = comm
                .recv(&Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap(), 0)
                .unwrap_err();
            assert!(matches!(
                dist(&e),
                DistributedError::Timeout {
                    op: "recv",
                    rank: 1,
                    ..
                }
            ));
        }
    });
    assert_eq!(out.len(), 2);
}

#[derive(Module)]
struct Two {
    a: Linear,
    b: Linear,
}

fn two() -> Two {
    Two {
        a: Linear::new(3, 4, &Device::Cpu).unwrap(),
        b: Linear::new(4, 2, &Device::Cpu).unwrap(),
    }
}

fn split_err(model: &Two, stages: Vec<Vec<&str>>) -> String {
    let split = PipelineSplit::new(stages).unwrap();
    let e = split.assign(model).unwrap_err();
    assert!(
        matches!(dist(&e), DistributedError::StageSplit { .. }),
        "{e}"
    );
    e.to_string()
}

#[test]
fn a_split_must_cover_the_model_once() {
    let model = two();
    let msg = split_err(&model, vec![vec!["a"], vec!["a.weight"]]);
    assert!(msg.contains("in no stage: `b.weight`, `b.bias`"), "{msg}");
    assert!(msg.contains("`a.weight` in stages [0, 1]"), "{msg}");
    let msg = split_err(&model, vec![vec!["a", "c"], vec!["b"]]);
    assert!(
        msg.contains("matching no parameter or buffer: `c` (stage 0)"),
        "{msg}"
    );
    // A weight tied across stages would be stepped twice.
    let tied = two();
    let mut tied = tied;
    tied.b = Linear::from_tensors(
        Tensor::zeros((4, 4), DType::F32, &Device::Cpu).unwrap(),
        None,
    )
    .unwrap();
    tied.b.weight = tied.a.weight.clone();
    let split = PipelineSplit::new([["a"], ["b"]]).unwrap();
    let e = split.assign(&tied).unwrap_err();
    assert!(e.to_string().contains("one tied parameter"), "{e}");

    assert!(PipelineSplit::new(Vec::<Vec<&str>>::new()).is_err());
    assert!(PipelineSplit::new([vec!["a"], vec![]]).is_err());
    // One stage per rank.
    let ok = PipelineSplit::new([["a"], ["b"]]).unwrap();
    let e = PipelineStage::new(&model, &ok, &SingleProcess, |x| Ok(x.clone())).unwrap_err();
    assert!(
        e.to_string().contains("2 stages for a group of 1 ranks"),
        "{e}"
    );
}

fn mse(y: &Tensor, t: &Tensor) -> Result<Tensor> {
    Ok((y - t)?.sqr()?.mean_all()?)
}

#[test]
fn a_refused_step_changes_nothing_and_the_next_one_runs() {
    let out = on_ranks(2, Duration::from_secs(30), |comm| -> Result<()> {
        module_runtime::manual_seed(3);
        let model = two();
        let split = PipelineSplit::new([["a"], ["b"]])?;
        let stage = PipelineStage::new(&model, &split, &comm, |x| match comm.rank() {
            0 => Ok(model.a.call(x)?.tanh()?),
            _ => model.b.call(x),
        })?;
        let before = stage.state_dict()?;
        let x = Tensor::ones((6, 3), DType::F32, &Device::Cpu)?;
        let y = Tensor::ones((6, 2), DType::F32, &Device::Cpu)?;
        let (first, last) = (stage.is_first(), stage.is_last());
        // 6 rows do not split into 4 micro-batches: refused on both ranks before anything ran.
        let e = ScheduleGPipe::new(&stage, 4, mse)?
            .step(first.then_some(&x), last.then_some(&y))
            .unwrap_err();
        let what = if first { "input" } else { "target" };
        assert_eq!(
            dist(&e),
            &DistributedError::MicroBatches {
                stage: comm.rank(),
                what,
                batch: 6,
                n_microbatches: 4
            }
        );
        assert!(
            e.to_string().contains("6 rows does not split into 4"),
            "{e}"
        );
        // Only the first stage's input is wrong: it says why, the last stage that another
        // stage refused; neither waits.
        let x5 = x.narrow(0, 0, 5)?;
        let e = ScheduleGPipe::new(&stage, 3, mse)?
            .step(first.then_some(&x5), last.then_some(&y))
            .unwrap_err();
        if first {
            assert!(
                matches!(dist(&e), DistributedError::MicroBatches { batch: 5, .. }),
                "{e}"
            );
        } else {
            assert!(e.to_string().contains("another stage refused"), "{e}");
        }
        // The first stage without its input, the last without its target.
        let e = ScheduleGPipe::new(&stage, 2, mse)?
            .step(None, None)
            .unwrap_err();
        assert!(
            matches!(dist(&e), DistributedError::PipelineInput { .. }),
            "{e}"
        );
        let e = ScheduleGPipe::new(&stage, 0, mse).err().unwrap();
        assert!(matches!(
            dist(&e),
            DistributedError::MicroBatches {
                n_microbatches: 0,
                ..
            }
        ));
        for (key, value) in before.iter() {
            let now = stage.state_dict()?;
            let diff = (value - now.get(key).unwrap())?.abs()?.sum_all()?;
            assert_eq!(diff.to_scalar::<f32>()?, 0.0, "{key}");
        }
        // The group is still in step: a valid step runs on both ranks.
        let step =
            ScheduleGPipe::new(&stage, 3, mse)?.step(first.then_some(&x), last.then_some(&y))?;
        assert_eq!(step.losses.len(), if last { 3 } else { 0 });
        assert_eq!(step.grads.get_ids().count(), 2);
        Ok(())
    });
    out.into_iter().for_each(|r| r.unwrap());
}

#[test]
fn a_stage_forward_reading_another_stages_weight_is_refused() {
    let out = on_ranks(2, Duration::from_secs(2), |comm| {
        let model = two();
        let split = PipelineSplit::new([["a"], ["b"]]).unwrap();
        // Stage 0 also runs `b` (built on every rank here), which the split gives to stage 1.
        let stage = PipelineStage::new(&model, &split, &comm, |x| match comm.rank() {
            0 => Ok(model
                .b
                .call(&model.a.call(x)?)?
                .sum_keepdim(1)?
                .broadcast_as((x.dim(0)?, 4))?
                .contiguous()?),
            _ => model.b.call(x),
        })
        .unwrap();
        let x = Tensor::ones((2, 3), DType::F32, &Device::Cpu).unwrap();
        let y = Tensor::ones((2, 2), DType::F32, &Device::Cpu).unwrap();
        let (first, last) = (stage.is_first(), stage.is_last());
        let schedule = ScheduleGPipe::new(&stage, 1, mse).unwrap();
        let result = schedule.step(first.then_some(&x), last.then_some(&y));
        result.map(|_| ())
    });
    let e = out[0].as_ref().unwrap_err();
    assert!(
        e.to_string().contains(
            "stage 0's forward used `b.bias`, `b.weight`, which the split puts on another stage"
        ),
        "{e}"
    );
    // The last stage had finished its part (one micro-batch): nothing waits for rank 0.
    assert!(out[1].is_ok(), "{:?}", out[1]);
}

#[test]
fn a_stage_loads_its_paths_all_or_nothing() {
    let full = two().state_dict().unwrap();
    let out = on_ranks(2, Duration::from_secs(30), |comm| -> Result<()> {
        let model = module_runtime::build_empty(two);
        let split = PipelineSplit::new([["a"], ["b"]])?;
        let stage = PipelineStage::new(&model, &split, &comm, |x| Ok(x.clone()))?;
        let mine = if comm.rank() == 0 { "a" } else { "b" };
        // A missing key of this stage: refused, naming only it.
        let mut partial = full.clone();
        partial.remove(&format!("{mine}.bias"));
        let e = stage.load_state_dict(&partial).unwrap_err();
        let Error::Load(report) = e.inner() else {
            panic!("{e}")
        };
        assert_eq!(report.missing, [format!("{mine}.bias")]);
        // A wrong shape: refused, nothing built, the other stage's paths not reported.
        let mut wrong = full.clone();
        wrong.insert(
            format!("{mine}.weight"),
            Tensor::zeros((1, 1), DType::F32, &Device::Cpu)?,
        );
        let e = stage.load_state_dict(&wrong).unwrap_err();
        let Error::Load(report) = e.inner() else {
            panic!("{e}")
        };
        assert!(report.missing.is_empty(), "{e}");
        assert_eq!(report.mismatched.len(), 1, "{e}");
        assert!(model.parameters().iter().all(|p| !p.is_built()));
        // The right values: this stage built, the other never.
        let report = stage.load_state_dict(&full)?;
        assert!(report.missing.is_empty());
        for (path, p) in model.named_parameters() {
            assert_eq!(p.is_built(), path.starts_with(mine), "{path}");
        }
        let sd = stage.state_dict()?;
        let keys: Vec<&str> = sd.keys().collect();
        assert_eq!(keys, [format!("{mine}.weight"), format!("{mine}.bias")]);
        Ok(())
    });
    out.into_iter().for_each(|r| r.unwrap());
}
