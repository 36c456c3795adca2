//! `TrainingCheckpoint`: a run saved after k steps, restored into parts made afresh (the generator
//! moved on, as in a new process) and continued for N - k steps ends with the uninterrupted run's
//! weights and optimizer state, bit for bit, dropout included; a restore that does not fit
//! changes nothing.

use module_runtime::candle_nn::loss::cross_entropy;
use module_runtime::nn::Dropout;
use module_runtime::optim::Error as OptimError;
use module_runtime::prelude::*;
use module_runtime::{get_rng_state, initial_seed};

use super::{bits, serial, Bits};

#[derive(Module)]
struct Net {
    fc1: Linear,
    drop: Dropout,
    head: Linear,
}

impl Forward<&Tensor> for Net {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.drop.call(&self.fc1.call(x)?.relu()?)?;
        self.head.call(&h)
    }
}

/// What a run is made of at its start: the model (seeded), AdamW over two groups, a warmup
/// schedule.
struct Run {
    model: Net,
    opt: AdamW,
    schedule: LambdaLr,
}

const STEPS: usize = 8;

fn start(seed: u64) -> Result<Run, OptimError> {
    let dev = Device::Cpu;
    manual_seed(seed);
    let model = Net {
        fc1: Linear::new(6, 32, &dev)?,
        drop: Dropout::new(0.5),
        head: Linear::new(32, 3, &dev)?,
    };
    model.train();
    let groups = ParamGroups::new().group("**.bias", |g| g.weight_decay(0.0));
    let mut opt = AdamW::with_groups(&model, AdamW::options().lr(1e-2), &groups)?;
    let schedule = LambdaLr::linear_with_warmup(&mut opt, 2, STEPS);
    Ok(Run {
        model,
        opt,
        schedule,
    })
}

/// Steps `from..to` of the run: each step's batch is fixed by its index, dropout draws from the
/// runtime's generator.
fn train(run: &mut Run, from: usize, to: usize) -> Result<(), OptimError> {
    let dev = Device::Cpu;
    for step in from..to {
        let x = Tensor::arange(0f32, 24., &dev)?
            .reshape((4, 6))?
            .affine(0.1, step as f64 * 0.01)?
            .sin()?;
        let y = Tensor::new(&[0u32, 1, 2, (step % 3) as u32], &dev)?;
        let loss = cross_entropy(&run.model.call(&x)?, &y)?;
        run.opt.step(&loss.backward()?)?;
        run.schedule.step(&mut run.opt);
    }
    Ok(())
}

fn state(run: &Run) -> Result<(Bits, Bits), OptimError> {
    Ok((bits(&run.model.state_dict()?), bits(&run.opt.state_dict()?)))
}

fn temp(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("{name}-{}.safetensors", std::process::id()))
}

#[test]
fn a_run_saved_restored_and_continued_equals_the_uninterrupted_run() -> Result<(), OptimError> {
    let _serial = serial();
    let path = temp("training-checkpoint");
    let k = 3;

    let mut whole = start(11)?;
    train(&mut whole, 0, STEPS)?;

    let mut first = start(11)?;
    train(&mut first, 0, k)?;
    let mut progress = TrainerState {
        epoch: 1,
        global_step: k,
        ..Default::default()
    };
    progress.values.insert("best_loss".into(), 0.5);
    TrainingCheckpoint::new(&first.model)
        .optimizer(&mut first.opt)
        .scheduler(&mut first.schedule)
        .save(&path, &progress)?;
    drop(first);

    // A new process: the parts made as at the start, the generator elsewhere.
    let mut resumed = start(999)?;
    train(&mut resumed, 0, 1)?;
    let restored = TrainingCheckpoint::new(&resumed.model)
        .optimizer(&mut resumed.opt)
        .scheduler(&mut resumed.schedule)
        .load(&path)?;
    assert_eq!(restored, progress);
    assert_eq!(initial_seed(), 11, "the generator is the saved run's");
    assert_eq!(resumed.schedule.last_epoch(), k);
    let rng_after_load = get_rng_state()?.to_vec1::<u8>()?;
    train(&mut resumed, k, STEPS)?;
    assert!(
        state(&resumed)? == state(&whole)?,
        "resumed run differs from the whole run"
    );

    // The generator's state is what makes it so: continued from another one, dropout differs.
    let mut other = start(999)?;
    TrainingCheckpoint::new(&other.model)
        .optimizer(&mut other.opt)
        .scheduler(&mut other.schedule)
        .load(&path)?;
    assert_eq!(get_rng_state()?.to_vec1::<u8>()?, rng_after_load);
    manual_seed(12345);
    train(&mut other, k, STEPS)?;
    assert!(state(&other)?.0 != state(&whole)?.0);
    std::fs::remove_file(&path).unwrap();
    Ok(())
}

#[test]
fn a_restore_that_does_not_fit_changes_nothing() -> Result<(), OptimError> {
    let _serial = serial();
    let path = temp("training-checkpoint-misfit");
    let mut saved = start(21)?;
    train(&mut saved, 0, 2)?;
    TrainingCheckpoint::new(&saved.model)
        .optimizer(&mut saved.opt)
        .scheduler(&mut saved.schedule)
        .save(&path, &TrainerState::default())?;

    // The model fits, the optimizer does not (one group where the run had two): the model,
    // loaded first, is put back, and neither the schedule nor the generator move.
    let dev = Device::Cpu;
    let mut other = start(22)?;
    train(&mut other, 0, 1)?;
    let mut one_group = AdamW::new(&other.model, AdamW::options().lr(1e-2))?;
    let mut schedule = LambdaLr::linear_with_warmup(&mut one_group, 2, STEPS);
    let (model_before, rng_before) = (bits(&other.model.state_dict()?), get_rng_state()?);
    let err = TrainingCheckpoint::new(&other.model)
        .optimizer(&mut one_group)
        .scheduler(&mut schedule)
        .load(&path)
        .unwrap_err();
    let message = err.to_string();
    assert!(
        matches!(&err, OptimError::Checkpoint { part, .. } if part == "optimizer"),
        "{message}"
    );
    assert!(message.contains("nothing was restored"), "{message}");
    assert_eq!(bits(&other.model.state_dict()?), model_before);
    assert_eq!(schedule.last_epoch(), 0);
    assert_eq!(
        get_rng_state()?.to_vec1::<u8>()?,
        rng_before.to_vec1::<u8>()?
    );

    // Parts the checkpoint does not have: named, nothing read into the model.
    let err = TrainingCheckpoint::new(&other.model)
        .optimizer(&mut other.opt)
        .load(&path)
        .unwrap_err()
        .to_string();
    assert!(err.contains("unexpected keys: `scheduler.*`"), "{err}");
    assert_eq!(bits(&other.model.state_dict()?), model_before);

    // Another model: its load fails first, and says why.
    let small = Linear::new(6, 3, &dev)?;
    let mut opt = AdamW::new(&small, AdamW::options())?;
    let mut schedule = LambdaLr::linear_with_warmup(&mut opt, 2, STEPS);
    let err = TrainingCheckpoint::new(&small)
        .optimizer(&mut opt)
        .scheduler(&mut schedule)
        .load(&path)
        .unwrap_err();
    let message = err.to_string();
    assert!(
        matches!(&err, OptimError::Checkpoint { part, .. } if part == "model"),
        "{message}"
    );
    assert!(message.contains("fc1.weight"), "{message}");
    std::fs::remove_file(&path).unwrap();
    Ok(())
}

/// The model the kill test saves: every value of every tensor is the step's number.
fn filled(step: usize) -> Result<(Linear, AdamW), OptimError> {
    let dev = Device::Cpu;
    let model = Linear::new(256, 256, &dev)?;
    let mut opt = AdamW::new(&model, AdamW::options())?;
    let loss = model
        .call(&Tensor::ones((2, 256), DType::F32, &dev)?)?
        .sum_all()?;
    opt.step(&loss.backward()?)?;
    for (_, p) in model.named_parameters() {
        p.set(&Tensor::full(step as f32, p.shape(), &dev)?)?;
    }
    Ok((model, opt))
}

/// Run by [`a_checkpoint_killed_mid_save_is_the_previous_or_the_new_one`] in a child process:
/// saves the checkpoint of step 1, 2, 3, … to `CHECKPOINT_PATH` until it is killed.
#[test]
#[ignore = "run in a child process, which the kill test kills"]
fn keep_saving_checkpoints() -> Result<(), OptimError> {
    let Some(path) = std::env::var_os("CHECKPOINT_PATH") else {
        return Ok(());
    };
    let first: usize = std::env::var("FIRST_STEP").unwrap().parse().unwrap();
    for step in first.. {
        let (model, mut opt) = filled(step)?;
        let state = TrainerState {
            global_step: step,
            ..Default::default()
        };
        TrainingCheckpoint::new(&model)
            .optimizer(&mut opt)
            .save(&path, &state)?;
    }
    Ok(())
}

/// A save killed at any moment (SIGKILL, no chance to clean up) leaves a whole checkpoint: the
/// file restores, and its weights are those of the step its trainer state names.
#[test]
fn a_checkpoint_killed_mid_save_is_the_previous_or_the_new_one() -> Result<(), OptimError> {
    // Restoring sets the generator (to the child's): not while another test draws.
    let _serial = serial();
    let path = temp("training-checkpoint-killed");
    let _ = std::fs::remove_file(&path);
    let mut last = 0;
    for (round, wait_ms) in [40u64, 90, 150, 230, 310, 420].into_iter().enumerate() {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "checkpoint::keep_saving_checkpoints",
            ])
            .env("CHECKPOINT_PATH", &path)
            .env("FIRST_STEP", (last + 1).to_string())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(wait_ms));
        child.kill().unwrap();
        child.wait().unwrap();
        if !path.exists() {
            assert_eq!(last, 0, "round {round}: the previous checkpoint is gone");
            continue;
        }
        let (model, mut opt) = filled(0)?;
        let state = TrainingCheckpoint::new(&model)
            .optimizer(&mut opt)
            .load(&path)?;
        assert!(state.global_step >= last, "round {round}: went back");
        let step = state.global_step as f32;
        for (name, p) in model.named_parameters() {
            let values = p.tensor()?.flatten_all()?.to_vec1::<f32>()?;
            assert!(
                values.iter().all(|&v| v == step),
                "round {round}: {name} is not step {step}'s"
            );
        }
        last = state.global_step;
    }
    assert!(last > 0, "no checkpoint was ever written");
    // The checkpoint, and a killed save's temporary file (the next save would have removed it).
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    for entry in std::fs::read_dir(std::env::temp_dir()).unwrap().flatten() {
        if entry.file_name().to_string_lossy().contains(&name) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    Ok(())
}
